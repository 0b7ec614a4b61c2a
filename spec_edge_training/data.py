"""The training data of spec-edge-train: the target's own greedy answers and what is read from them.

The target (transformers, fp32; load_hf_target) answers every prompt (read_prompts, in its chat
template: chat_prompt_ids) greedily, --gen-batch prompts at a time (answer_batch), recording per
position the three auxiliary hidden states, the final-norm hidden state and the target's argmax;
make_data caches them in --data-cache and reuses them across runs and kinds. From the data:
draft_vocabulary (the draft-to-target id map), feature_std (the heads' input scaling) and batches
(the endless shuffled stream the fit loop draws from).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
                log(f"[spec-edge-train] reusing {n_reused} target answers from {cache}")
                return data
            log(f"[spec-edge-train] reusing {n_reused} of {len(prompts)} target answers from {cache}; "
                f"answering the other {len(prompts) - n_reused}")
    missing = sorted((i for i, item in enumerate(data) if item is None), key=lambda i: len(prompt_ids[i]))

    def save() -> None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        torch.save({"key": key, "data": data}, str(tmp))  # None = not answered yet
        tmp.replace(cache)

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(missing), desc="[spec-edge-train] target answers",
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
    log(f"[spec-edge-train] {len(data)} answers, {n_tokens} tokens (prompts included)")
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
    log(f"[spec-edge-train] draft vocabulary {draft_vocab} of {vocab_size} tokens covers {covered:.1%} "
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

