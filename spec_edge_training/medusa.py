"""spec-edge-train --kind medusa: Medusa heads (spec_edge/heads/medusa.py) trained Medusa-1 style.

The heads learn from the target's own final-norm states of its greedy answers (the target is
frozen): head i's label is the target's argmax i positions ahead (_rows), the loss decayed by 0.8
per head; the held-out score is each head's top-1 agreement over the answer positions. The loop is
fit.fit; the heads are saved as a Medusa folder (heads.medusa.save_heads).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads.medusa import MedusaConfig, build_module, save_heads
from spec_edge_training.fit import draft_vocab_map, fit, load_resume, split


def config_for(target: ModelConfig, n_heads: int, draft_vocab_size: int, n_layers: int = 1) -> MedusaConfig:
    return MedusaConfig(n_heads=n_heads, hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
                        draft_vocab_size=draft_vocab_size, n_layers=n_layers, target_layers=target.n_layers)


def init_state(mcfg: MedusaConfig, target_state: dict, draft_ids: np.ndarray, seed: int = 0,
               std: float = 0.0) -> dict:
    """Fresh heads: each head's output rows are the target's lm_head rows of the draft vocabulary;
    the ResBlocks start at zero (std = 0: every head begins as the target's own next-token head, as
    Medusa does) or random with std (for tests)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    H = mcfg.hidden_size
    target_head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])
    rows = target_head[torch.from_numpy(np.asarray(draft_ids))].float()
    state = {}
    for i in range(mcfg.n_heads):
        for j in range(mcfg.n_layers):
            state[f"medusa_head.{i}.{j}.linear.weight"] = torch.randn(H, H, generator=gen) * std
            state[f"medusa_head.{i}.{j}.linear.bias"] = torch.randn(H, generator=gen) * std
        state[f"medusa_head.{i}.{mcfg.n_layers}.weight"] = rows.clone()
    return state


def _rows(items: list[dict], t2d, n_heads: int, answer_only: bool = False):
    """h (R, H) float32 and labels (n, R) in draft ids (-100 = none): head i (0-based) at row t
    predicts token t + i + 2, i.e. the target's argmax at t + i + 1."""
    import torch

    hs, labels = [], []
    for item in items:
        N = len(item["tokens"])
        lab = torch.full((n_heads, N), -100, dtype=torch.long)
        target = item["labels"].long()
        for i in range(n_heads):
            if N > i + 1:
                lab[i, :N - i - 1] = t2d[target[i + 1:]]
            if answer_only:  # score the answer only: predicted token index t + i + 2 >= n_prompt
                lab[i, :max(item["n_prompt"] - i - 2, 0)] = -100
        hs.append(item["hlast"].float())
        labels.append(lab)
    return torch.cat(hs), torch.cat(labels, dim=1)


def train_medusa(args, argv: list[str], data: list[dict], target_state: dict, cfg: ModelConfig, out: Path,
                 eos_ids) -> int:
    import torch

    n_heads = args.medusa_heads
    if n_heads < 1:
        raise ConfigError(f"--medusa-heads must be >= 1, got {n_heads}")
    if any("hlast" not in item for item in data):
        raise ConfigError("the training data lacks the final-norm hidden states (hlast) Medusa heads learn from")
    identity = {"kind": "medusa", "draft_vocab": args.draft_vocab, "n_heads": n_heads,
                "n_layers": args.medusa_layers, "train_lm_head": args.train_lm_head}
    resume = load_resume(out, identity)
    draft_ids, t2d = draft_vocab_map(resume, data, cfg.vocab_size, args.draft_vocab, eos_ids)
    mcfg = config_for(cfg, n_heads, len(draft_ids), args.medusa_layers)
    module = build_module(mcfg, init_state(mcfg, target_state, draft_ids, args.seed))
    if not args.train_lm_head:  # keep the target's own output rows: less to overfit
        for head in module.medusa_head:
            head[-1].weight.requires_grad_(False)
    weights = [0.8 ** i for i in range(n_heads)]
    eval_data, train_data = split(data)

    def batch_loss(items):
        h, labels = _rows(items, t2d, n_heads)
        losses = []
        for w, logits, lab in zip(weights, module.heads(h), labels):
            valid = lab != -100
            if valid.any():
                losses.append(w * torch.nn.functional.cross_entropy(logits[valid], lab[valid]))
        return sum(losses) / sum(weights)

    def evaluate() -> list[float]:
        """Top-1 agreement with the target per head on the held-out answers."""
        hits, total = np.zeros(n_heads), np.zeros(n_heads)
        for start in range(0, len(eval_data), args.batch):  # (rows, n, Vd) logits: a batch at a time
            h, labels = _rows(eval_data[start:start + args.batch], t2d, n_heads, answer_only=True)
            for i, (logits, lab) in enumerate(zip(module.heads(h), labels)):
                valid = lab != -100
                hits[i] += (logits[valid].argmax(-1) == lab[valid]).sum().item()
                total[i] += valid.sum().item()
        return list(hits / np.maximum(total, 1))

    def save_head(extra: dict) -> None:
        save_heads(out, mcfg, dict(module.state_dict()), draft_ids, dtype=args.dtype, extra=extra)

    return fit(args=args, argv=argv, out=out, kind="medusa", module=module, identity=identity,
               resume=resume, draft_ids=draft_ids, train_data=train_data, batch_loss=batch_loss,
               evaluate=evaluate, save_head=save_head, n_sequences=len(data))
