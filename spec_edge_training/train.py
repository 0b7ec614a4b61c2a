"""spec-edge-train: train a drafter on the target's own greedy outputs.

    spec-edge-train --out heads/smollm2-135m-eagle3 [--kind eagle3|medusa|peagle|draft]
                          [--target embedded] [--prompts data/train_prompts.txt] [--time-budget 300] ...

1. data   the target (transformers, fp32) answers every prompt greedily, --gen-batch prompts at a
          time, recording per position the three auxiliary hidden states, the final-norm hidden
          state and the target's argmax. Cached in --data-cache (default <out>/train_data.pt); runs
          of other kinds on the same prompts reuse it, and a run over more prompts answers only the
          ones the cache lacks (saved every ~500 prompts, so an interrupted run loses little).
          (data.make_data)
2. vocab  the draft vocabulary: the most frequent tokens of the target's outputs (+ EOS).
          (data.draft_vocabulary)
3. train  --kind eagle3: training-time test as in EAGLE-3: each batch is unrolled --ttt-steps draft
          steps, step j consuming the head's own hidden state of step j-1, loss (decayed by 0.8
          per step) against the target's own softmax over the draft vocabulary (--loss
          distribution, EAGLE-3's) or its argmax (--loss argmax) (eagle3.train_eagle3). The loop
          (fit.fit) is the same for every kind: checkpoints every --save-every steps into <out>
          (the layout the config loads) keeping the best on held-out answers,
          <out>/train_state.pt (optimizer, step); a rerun resumes.
Bounded by --steps and --time-budget (seconds of training), with a progress bar on stderr.

The other kinds' training lives beside it in spec_edge_training/: medusa.train_medusa (Medusa
heads), peagle.train_peagle (parallel drafting), draft_model.train_draft_model (a small separate
draft model); the heads themselves (config, checkpoints, module, export) are in spec_edge/heads/.
The exact commands that made the committed heads are in heads/README.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spec_edge.config import EMBEDDED, ConfigError
from spec_edge_training.data import load_hf_target, log, make_data


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spec-edge-train",
                                description="train an EAGLE-3 head on the target's own greedy outputs")
    p.add_argument("--kind", choices=("eagle3", "medusa", "peagle", "draft"), default="eagle3",
                   help="what to train: an EAGLE-3 head, Medusa heads (spec_edge/heads/medusa.py), a "
                        "parallel-drafting P-EAGLE head (spec_edge/heads/peagle.py) or a small separate "
                        "draft model (spec_edge_training/draft_model.py)")
    p.add_argument("--draft-layers", type=int, default=4, help="--kind draft: decoder layers of the draft model")
    p.add_argument("--target", default=EMBEDDED, help="target model: 'embedded', a .gguf file or a HF folder")
    p.add_argument("--out", required=True, help="head folder to write (and resume from)")
    p.add_argument("--prompts", default="data/train_prompts.txt", help="one prompt per line")
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="target answer length per prompt")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts the target answers together")
    p.add_argument("--data-cache", help="file caching the target's answers and hidden states, shared by "
                   "runs that train other kinds on the same data (default <out>/train_data.pt)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--aux-layers", type=int, nargs=3, help="target layer outputs fed to the head "
                   "(default EAGLE-3's: 1, L/2-1, L-4)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--loss", choices=("distribution", "argmax"), default="distribution",
                   help="--kind eagle3: match the target's softmax over the draft vocabulary (EAGLE-3's "
                        "loss) or only its argmax")
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--steps", type=int, default=2000, help="training steps at most")
    p.add_argument("--time-budget", type=float, default=300.0, help="training seconds at most (this run)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-lm-head", action="store_true",
                   help="also train lm_head and the final norm (default: frozen at the target's rows)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                   help="dtype of the saved head tensors")
    p.add_argument("--medusa-heads", type=int, default=4, help="--kind medusa: heads (drafts per pass, k <= it)")
    p.add_argument("--medusa-layers", type=int, default=1, help="--kind medusa: ResBlocks per head")
    p.add_argument("--parallel-k", type=int, default=5,
                   help="--kind peagle: draft positions trained per pass (k <= it at run time)")
    p.add_argument("--anchors", type=int, default=32,
                   help="--kind peagle: positions per sequence and step that get a parallel draft")
    return p.parse_args(argv)

def train_main(argv: list[str]) -> int:
    import torch

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from spec_edge.graphs import hidden

    log(f"[spec-edge-train] loading target {args.target} ...")
    model, tok, cfg = load_hf_target(args.target)
    aux = tuple(args.aux_layers) if args.aux_layers else hidden.default_aux_layers(cfg.n_layers)
    if list(aux) != sorted(set(aux)) or not all(0 <= i < cfg.n_layers for i in aux):
        raise ConfigError(f"--aux-layers {list(aux)} must be three distinct ascending layers of the "
                          f"{cfg.n_layers}-layer target")
    eos = set(cfg.eos_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    data = make_data(args, model, tok, aux, eos, out)
    target_state = {name: t.detach().float() for name, t in model.state_dict().items()}
    if "lm_head.weight" not in target_state or cfg.tie_embeddings:
        target_state["lm_head.weight"] = target_state["model.embed_tokens.weight"]
    hf_config = model.config.to_dict()
    del model
    if args.kind == "draft":
        from spec_edge_training.draft_model import train_draft_model

        return train_draft_model(args, argv, data, target_state, cfg, hf_config, out)
    if args.kind == "medusa":
        from spec_edge_training.medusa import train_medusa

        return train_medusa(args, argv, data, target_state, cfg, out, eos)
    if args.kind == "peagle":
        from spec_edge_training.peagle import train_peagle

        return train_peagle(args, argv, data, target_state, cfg, out, eos, aux)
    from spec_edge_training.eagle3 import train_eagle3

    return train_eagle3(args, argv, data, target_state, cfg, out, eos, aux)


def main(argv: list[str] | None = None) -> int:
    """The spec-edge-train console script: exit 2 with the message on a setting that cannot be used."""
    try:
        return train_main(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"spec-edge-train: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
