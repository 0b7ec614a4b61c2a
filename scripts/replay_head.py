"""Predict an EAGLE-3 head's live mean accepted length in a minute, without the live loop.

The target (transformers, fp32) answers the held-out prompts greedily; each head then runs over
those answers teacher-forced (train_forward, as in training) and the live greedy loop is replayed on
its chain predictions (fit.replay_chain): draft k from the last verified pair, keep the
agreeing prefix and the target's own token, move on. On the 12 free-form eval prompts this matched
the live runs (heads/README.md) within 0.01-0.02 at k=2..5 (heads/README.md). Also
printed: top-1 agreement per draft position over all answer positions (what training reports).

    .venv/bin/python scripts/replay_head.py heads/smollm2-135m-eagle3 [other head folders ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spec_edge.heads import eagle3
from spec_edge.tools.prompts import load_prompts
from spec_edge_training import data as train_data, fit
from spec_edge_training.eagle3 import answer_agreement, collate, train_forward


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("heads", nargs="+", help="EAGLE-3 head folders (model.safetensors + config.json)")
    p.add_argument("--prompts", default="data/eval_prompts.jsonl")
    p.add_argument("--kinds", nargs="+", default=["free-form"])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = [entry["prompt"] for entry in load_prompts(Path(args.prompts), args.kinds)]
    if not prompts:
        raise SystemExit(f"no prompts of kinds {args.kinds} in {args.prompts}")
    model, tok, cfg = train_data.load_hf_target("embedded")
    prompt_ids = train_data.chat_prompt_ids(tok, prompts)
    eos_ids = set(cfg.eos_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
    embed = model.get_input_embeddings().weight.detach().float()  # (V, H)
    n_steps = max(args.ks)
    answers_by_aux: dict[tuple, list[dict]] = {}
    started = time.monotonic()
    print(f"{len(prompts)} prompts ({', '.join(args.kinds)}), {args.max_new_tokens} new tokens")
    for head in args.heads:
        hcfg, state, draft_ids = eagle3.load_head(head, cfg)
        module = eagle3.build_module(hcfg, state).eval()
        aux = tuple(hcfg.aux_layers)
        if aux not in answers_by_aux:  # the target's answers, with the hidden states this head reads
            answers_by_aux[aux] = train_data.answer_batch(model, prompt_ids, args.max_new_tokens, eos_ids, pad_id, aux)
        items = answers_by_aux[aux]
        to_target = torch.from_numpy(np.asarray(draft_ids))
        t2d = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
        t2d[to_target] = torch.arange(len(to_target))
        replayed = {k: [0, 0] for k in args.ks}  # k -> [verify calls, tokens emitted]
        with torch.no_grad():
            for start in range(0, len(items), 8):
                batch = items[start:start + 8]
                emb, hid, _ = collate(batch, t2d, embed, n_steps)
                outs = train_forward(module, hcfg, emb, hid, n_steps)
                chain_preds = [to_target[module.lm_head(normed).argmax(-1)] for normed in outs]  # (B, N) each
                for b, item in enumerate(batch):
                    for k in args.ks:
                        calls, emitted = fit.replay_chain([pred[b] for pred in chain_preds],
                                                                 item["tokens"], item["n_prompt"], k)
                        replayed[k][0] += calls
                        replayed[k][1] += emitted
            agreement = " / ".join(f"{a:.3f}" for a in answer_agreement(module, hcfg, items, t2d, embed, n_steps, 8))
        lengths = " / ".join(f"{emitted / calls:.3f}" for calls, emitted in replayed.values())
        steps = json.loads((Path(head) / "config.json").read_text()).get("spec_edge", {}).get("trained_steps", "?")
        print(f"{head} (step {steps}): agreement per draft position {agreement}; "
              f"replayed MAL at k={'/'.join(map(str, args.ks))}: {lengths}")
    print(f"[{time.monotonic() - started:.0f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
