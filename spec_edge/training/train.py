"""spec-edge train-draft: train a drafter on the target's own greedy outputs.

    spec-edge train-draft --out heads/smollm2-135m-eagle3 [--kind eagle3|medusa|peagle|draft]
                          [--target embedded] [--prompts data/train_prompts.txt] [--time-budget 300] ...

1. data   the target (transformers, fp32) answers every prompt greedily, --gen-batch prompts at a
          time, recording per position the three auxiliary hidden states, the final-norm hidden
          state and the target's argmax. Cached in --data-cache (default <out>/train_data.pt); runs
          of other kinds on the same prompts reuse it, and a run over more prompts answers only the
          ones the cache lacks (saved every ~500 prompts, so an interrupted run loses little).
2. vocab  the draft vocabulary: the most frequent tokens of the target's outputs (+ EOS).
3. train  --kind eagle3: training-time test as in EAGLE-3: each batch is unrolled --ttt-steps draft
          steps, step j consuming the head's own hidden state of step j-1, loss (decayed by 0.8
          per step) against the target's own softmax over the draft vocabulary (--loss
          distribution, EAGLE-3's) or its argmax (--loss argmax). The loop (head_train.fit) is
          the same for every kind: checkpoints every --save-every steps into <out> (the layout
          the config loads) keeping the best on held-out answers, <out>/train_state.pt
          (optimizer, step); a rerun resumes.
Bounded by --steps and --time-budget (seconds of training), with a progress bar on stderr.

The other kinds' code lives with each drafter: medusa.train_medusa (Medusa heads), peagle.train_peagle
(parallel drafting), distill.train_draft_model (a small separate draft model); the exact commands that
made the committed heads are in heads/README.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from spec_edge.config import EMBEDDED, ConfigError


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spec-edge train-draft",
                                description="train an EAGLE-3 head on the target's own greedy outputs")
    p.add_argument("--kind", choices=("eagle3", "medusa", "peagle", "draft"), default="eagle3",
                   help="what to train: an EAGLE-3 head, Medusa heads (spec_edge/medusa.py), a "
                        "parallel-drafting P-EAGLE head (spec_edge/peagle.py) or a small separate draft "
                        "model (spec_edge/distill.py)")
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


def load_hf_target(source: str):
    """(transformers model in eval mode, its tokenizer, our ModelConfig)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_edge.graphs import weights

    path = weights.resolve(source)
    if path.is_file():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32")
    cfg = weights.config_from_hf(model.config.to_dict())
    return model.eval(), tok, cfg


def read_prompts(path: str, limit: int) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"prompt file {path} does not exist (one prompt per line)")
    prompts = [line.strip() for line in file.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts")
    return prompts[:limit] if limit else prompts


def chat_prompt_ids(tok, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn in the target's chat template, ready for the answer."""
    ids = [tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False) for prompt in prompts]
    return [list(one["input_ids"] if isinstance(one, dict) else one) for one in ids]


def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                 aux_layers) -> list[dict]:
    """Greedy answers of the transformers target to a batch of prompt id lists, one forward per
    token for the whole batch (left-padded, with a KV cache), recording per fed position the three
    aux hidden states, the final-norm hidden state (what feeds lm_head) and the argmax.

    Returns per prompt {tokens (N,), hid3 (N, 3H) float16, hlast (N, H) float16, labels (N,),
    n_prompt}; N = prompt + answer (the answer ends with EOS when the target stopped)."""
    import torch

    n_batch = len(prompts)
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((n_batch, width), pad_id, dtype=torch.long)           # (B, P)
    attention = torch.zeros((n_batch, width), dtype=torch.long)                  # (B, P)
    for b, ids in enumerate(prompts):
        input_ids[b, width - len(ids):] = torch.tensor(ids)
        attention[b, width - len(ids):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)                          # (B, P)
    fed_to_head: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: fed_to_head.append(inp[0]))
    records: list[list[tuple]] = [[] for _ in range(n_batch)]  # per row: (hid3, hlast, label) chunks
    answers: list[list[int]] = [[] for _ in range(n_batch)]
    done = [False] * n_batch
    past = None
    step_input, step_pos = input_ids, positions
    try:
        with torch.no_grad():
            for step in range(max_new_tokens + 1):
                out = model(input_ids=step_input, attention_mask=attention, position_ids=step_pos,
                            cache=past, use_cache=True, output_hidden_states=True)
                past = out.cache
                hs = out.hidden_states  # hs[j + 1] = output of layer j
                hid3 = torch.cat([hs[i + 1] for i in aux_layers], dim=-1).to(torch.float16)  # (B, T, 3H)
                hlast = fed_to_head.pop().to(torch.float16)                                   # (B, T, H)
                labels = out.logits.argmax(-1)                                                # (B, T)
                for b in range(n_batch):
                    if step == 0:
                        n = len(prompts[b])
                        records[b].append((hid3[b, -n:], hlast[b, -n:], labels[b, -n:]))
                    elif not done[b]:
                        records[b].append((hid3[b], hlast[b], labels[b]))
                        if answers[b][-1] in eos_ids or len(answers[b]) >= max_new_tokens:
                            done[b] = True  # its last token has been fed: hidden + label recorded
                if all(done):
                    break
                nxt = labels[:, -1]
                for b in range(n_batch):
                    if not done[b]:
                        answers[b].append(int(nxt[b]))
                step_input = nxt[:, None]
                attention = torch.cat([attention, torch.ones((n_batch, 1), dtype=torch.long)], dim=1)
                step_pos = step_pos[:, -1:] + 1
    finally:
        hook.remove()
    items = []
    for b in range(n_batch):
        hid3, hlast, labels = (torch.cat(parts) for parts in zip(*records[b]))
        tokens = torch.tensor(prompts[b] + answers[b])
        items.append({"tokens": tokens, "hid3": hid3.clone(), "hlast": hlast.clone(), "labels": labels.clone(),
                      "n_prompt": len(prompts[b])})
    return items


def make_data(args, model, tok, aux_layers, eos_ids: set[int], out: Path) -> list[dict]:
    """Per prompt: tokens (N,), hid3 (N, 3H) float16, hlast (N, H) float16, labels (N,) = target
    argmax, n_prompt. The target (transformers, fp32) answers greedily with the chat template, in
    batches of --gen-batch prompts sorted by length (one forward per token for the whole batch:
    ~10x the throughput of one-by-one decoding on this CPU); the hidden states and argmax are
    recorded on the way (no second pass). Cached in --data-cache (default <out>/train_data.pt).

    Nothing answered is lost: the cache is saved every ~500 prompts, and a cache made with another
    --max-prompts (or cut short) is reused for every prompt whose chat-templated ids it holds, so
    only the missing answers are generated."""
    import torch
    from tqdm import tqdm

    cache = Path(args.data_cache) if args.data_cache else out / "train_data.pt"
    # what the answers depend on; not --max-prompts: answers are matched prompt by prompt
    key = {"target": args.target, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "aux_layers": list(aux_layers), "format": 2}
    prompts = read_prompts(args.prompts, args.max_prompts)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
    prompt_ids = chat_prompt_ids(tok, prompts)
    data: list[dict | None] = [None] * len(prompts)
    if cache.is_file():
        saved = torch.load(str(cache), weights_only=False)
        saved_key = {name: value for name, value in saved.get("key", {}).items()
                     if name != "max_prompts"}  # caches before session 6 also recorded it
        if saved_key == key:
            by_prompt = {tuple(item["tokens"][:item["n_prompt"]].tolist()): item
                         for item in saved["data"] if item is not None}
            data = [by_prompt.get(tuple(ids)) for ids in prompt_ids]
            n_reused = sum(item is not None for item in data)
            if n_reused == len(prompts):  # a cache of more prompts stays as it is: nothing is dropped
                log(f"[train-draft] reusing {n_reused} target answers from {cache}")
                return data
            log(f"[train-draft] reusing {n_reused} of {len(prompts)} target answers from {cache}; "
                f"answering the other {len(prompts) - n_reused}")
    missing = sorted((i for i, item in enumerate(data) if item is None), key=lambda i: len(prompt_ids[i]))

    def save() -> None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        torch.save({"key": key, "data": data}, str(tmp))  # None = not answered yet
        tmp.replace(cache)

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(missing), desc="[train-draft] target answers",
               unit="prompt", file=sys.stderr)
    since_save = 0
    for start in range(0, len(missing), args.gen_batch):
        chunk = missing[start:start + args.gen_batch]
        for i, item in zip(chunk, answer_batch(model, [prompt_ids[i] for i in chunk], args.max_new_tokens,
                                               eos_ids, pad_id, aux_layers)):
            data[i] = item
        bar.update(len(chunk))
        since_save += len(chunk)
        if since_save >= 500 and start + args.gen_batch < len(missing):
            save()
            since_save = 0
    bar.close()
    n_tokens = sum(len(item["tokens"]) for item in data)
    log(f"[train-draft] {len(data)} answers, {n_tokens} tokens (prompts included)")
    save()
    return data


def draft_vocabulary(data: list[dict], vocab_size: int, draft_vocab: int, eos_ids) -> np.ndarray:
    """The draft-to-target id map: the draft_vocab most frequent target outputs, ascending ids."""
    counts = np.zeros(vocab_size, np.int64)
    for item in data:
        np.add.at(counts, item["labels"].numpy(), 1)
        np.add.at(counts, item["tokens"].numpy(), 1)
    for e in eos_ids:
        counts[e] += counts.max() + 1
    draft_vocab = min(draft_vocab, vocab_size)
    top = np.argsort(-counts, kind="stable")[:draft_vocab]
    covered = counts[top].sum() / max(counts.sum(), 1)
    log(f"[train-draft] draft vocabulary {draft_vocab} of {vocab_size} tokens covers {covered:.1%} "
        f"of the target's tokens in the training answers")
    return np.sort(top)


def feature_std(data: list[dict]):
    """Per-column standard deviation (3H,) of the cached aux hidden states over all positions, summed
    sequence by sequence in float64: no float32 copy of the whole cache (7 GB for 1.1M tokens)."""
    import torch

    total = torch.zeros(data[0]["hid3"].shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    count = 0
    for item in data:
        hid3 = item["hid3"].double()
        total += hid3.sum(0)
        squares += (hid3 * hid3).sum(0)
        count += hid3.shape[0]
    mean = total / count
    return ((squares - count * mean * mean) / max(count - 1, 1)).clamp(min=0).sqrt().float()


def batches(data: list[dict], batch: int, rng: np.random.Generator):
    while True:
        order = rng.permutation(len(data))
        for start in range(0, len(order) - batch + 1, batch):
            yield [data[i] for i in order[start:start + batch]]


def collate(items: list[dict], t2d, embed, ttt: int, with_hlast: bool = False):
    """emb_steps (ttt, B, N, H), hid3 (B, N, 3H), labels (ttt, B, N) in draft ids (-100 = none),
    and with with_hlast the target's final-norm hidden state behind each label, hlast_steps
    (ttt, B, N, H): what the target's own distribution over the draft vocabulary is computed from."""
    import torch

    n = max(len(item["tokens"]) for item in items) - 1  # pairs (h_t, x_{t+1}) for t < len - 1
    B = len(items)
    tokens = torch.zeros(B, n + ttt + 1, dtype=torch.long)
    labels_t = torch.full((B, n + ttt + 1), -1, dtype=torch.long)
    hid3 = torch.zeros(B, n, items[0]["hid3"].shape[1])
    hlast = torch.zeros(B, n + ttt + 1, items[0]["hlast"].shape[1]) if with_hlast else None
    for b, item in enumerate(items):
        length = len(item["tokens"])
        tokens[b, :length] = item["tokens"]
        labels_t[b, :length] = item["labels"]  # prompt positions too: the target's own next-token choices
        hid3[b, :length - 1] = item["hid3"][:length - 1].float()
        if with_hlast:
            hlast[b, :length] = item["hlast"].float()
    emb_steps = torch.stack([embed[tokens[:, j + 1:j + 1 + n]] for j in range(ttt)])  # token t+j+1
    target = torch.stack([labels_t[:, j + 1:j + 1 + n] for j in range(ttt)])          # argmax at t+j+1
    draft_labels = torch.where(target >= 0, t2d[target.clamp(min=0)], torch.full_like(target, -100))
    if not with_hlast:
        return emb_steps, hid3, draft_labels
    hlast_steps = torch.stack([hlast[:, j + 1:j + 1 + n] for j in range(ttt)])       # (ttt, B, N, H)
    return emb_steps, hid3, draft_labels, hlast_steps


def answer_agreement(module, items: list[dict], t2d, embed, n_steps: int, batch: int) -> list[float]:
    """Top-1 agreement of an EAGLE-3 head (train_forward) with the target per draft step, over the
    answer positions of items (prompts excluded), teacher-forced."""
    hits, total = np.zeros(n_steps), np.zeros(n_steps)
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        emb, hid, labels = collate(chunk, t2d, embed, n_steps)
        for b, item in enumerate(chunk):  # score the answer only: step j at t predicts t+j+2
            for j in range(n_steps):
                labels[j, b, :max(item["n_prompt"] - j - 2, 0)] = -100
        for j, normed in enumerate(module.train_forward(emb, hid, n_steps)):
            valid = labels[j] != -100
            hits[j] += (module.lm_head(normed[valid]).argmax(-1) == labels[j][valid]).sum().item()
            total[j] += valid.sum().item()
    return list(hits / np.maximum(total, 1))


def train_main(argv: list[str]) -> int:
    import torch

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from spec_edge.heads import eagle3

    log(f"[train-draft] loading target {args.target} ...")
    model, tok, cfg = load_hf_target(args.target)
    aux = tuple(args.aux_layers) if args.aux_layers else eagle3.default_aux_layers(cfg.n_layers)
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
        from spec_edge.training.draft_model import train_draft_model

        return train_draft_model(args, argv, data, target_state, cfg, hf_config, out)
    if args.kind != "eagle3":  # kind-specific training lives with the head: medusa.py, peagle.py
        from spec_edge.heads import medusa, peagle

        if args.kind == "medusa":
            return medusa.train_medusa(args, argv, data, target_state, cfg, out, eos)
        return peagle.train_peagle(args, argv, data, target_state, cfg, out, eos, aux)

    return train_eagle3(args, argv, data, target_state, cfg, out, eos, aux)


def train_eagle3(args, argv: list[str], data: list[dict], target_state: dict, cfg, out: Path, eos_ids,
                 aux: tuple[int, ...]) -> int:
    """Training-time test over --ttt-steps unrolled draft steps, loss decayed by 0.8 per step."""
    import torch

    from spec_edge.heads import eagle3
    from spec_edge.training import fit as head_train

    identity = {"kind": "eagle3", "draft_vocab": args.draft_vocab, "aux": list(aux), "ttt": args.ttt_steps,
                "train_lm_head": args.train_lm_head}
    resume = head_train.load_resume(out, identity)
    draft_ids, t2d = head_train.draft_vocab_map(resume, data, cfg.vocab_size, args.draft_vocab, eos_ids)
    hcfg = eagle3.head_config_for(cfg, len(draft_ids), aux)
    module = eagle3.build_module(hcfg, eagle3.init_state(hcfg, target_state, draft_ids, args.seed, feature_std(data)))
    if not args.train_lm_head:  # keep the target's own output rows and final norm: less to overfit
        module.lm_head.weight.requires_grad_(False)
        module.norm.weight.requires_grad_(False)
    embed = target_state["model.embed_tokens.weight"]
    weights = [0.8 ** j for j in range(args.ttt_steps)]
    eval_data, train_data = head_train.split(data)

    target_rows = target_state.get("lm_head.weight", embed)[torch.from_numpy(draft_ids)]  # (Vd, H) frozen

    def step_loss(normed, labels, hlast):
        """--loss argmax: cross-entropy on the target's argmax; --loss distribution: cross-entropy on
        the target's own softmax over the draft vocabulary (EAGLE-3's loss; more signal per token).
        Positions whose target argmax is outside the draft vocabulary are left out of both."""
        valid = labels != -100
        log_q_draft = torch.log_softmax(module.lm_head(normed[valid]).float(), dim=-1)   # (M, Vd)
        if args.loss == "argmax":
            return torch.nn.functional.nll_loss(log_q_draft, labels[valid])
        p_target = torch.softmax(hlast[valid] @ target_rows.T, dim=-1)                  # (M, Vd)
        return -(p_target * log_q_draft).sum(-1).mean()

    def batch_loss(items):
        emb, hid, labels, hlast = collate(items, t2d, embed, args.ttt_steps, with_hlast=True)
        outs = module.train_forward(emb, hid, args.ttt_steps)
        return sum(w * step_loss(o, lab, hl) for w, o, lab, hl in zip(weights, outs, labels, hlast)) / sum(weights)

    def evaluate() -> list[float]:
        return answer_agreement(module, eval_data, t2d, embed, args.ttt_steps, args.batch)

    def save_head(extra: dict) -> None:
        eagle3.save_head(out, hcfg, dict(module.state_dict()), draft_ids, dtype=args.dtype, extra=extra)

    return head_train.fit(args=args, argv=argv, out=out, kind="eagle3", module=module, identity=identity,
                          resume=resume, draft_ids=draft_ids, train_data=train_data, batch_loss=batch_loss,
                          evaluate=evaluate, save_head=save_head, n_sequences=len(data))


def main(argv: list[str] | None = None) -> int:
    return train_main(sys.argv[1:] if argv is None else argv)
