"""spec-edge-train --kind peagle: a parallel-drafting P-EAGLE head (spec_edge/heads/peagle.py).

Per batch: all real pairs of a sequence (draft 1 at every position) plus, for --anchors sampled
positions per sequence, k-1 mask rows that see the real pairs up to their anchor and the anchor's
earlier mask rows (one attention mask over real + mask rows, as P-EAGLE trains: the head's
train_forward; the rows and labels from _collate), the loss on the target's argmax (decayed by 0.8
per position). The held-out score is the top-1 agreement per draft position with every answer
position an anchor. The loop is fit.fit; the head is saved as a P-EAGLE folder (heads.peagle.save_head).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads import eagle3
from spec_edge.heads.peagle import build_module, init_state, save_head
from spec_edge_training.data import feature_std
from spec_edge_training.fit import draft_vocab_map, fit, load_resume, split


def _collate(items: list[dict], t2d, embed, k: int, anchors_per_seq: int, rng: np.random.Generator | None):
    """emb_real (B, n, H), hid3 (B, n, 3Ht), anchors (B, A), labels (B, n + A*(k-1)) in draft ids.
    Real row t (the pair (h_t, x_{t+1})) is labelled with the target's argmax at t+1 (token t+2);
    mask row j of anchor t with the argmax at t+1+j. rng None: every answer position is an anchor
    (held-out scoring, batch of one), and only answer tokens are scored."""
    import torch

    n = max(len(item["tokens"]) for item in items) - 1
    B, m = len(items), k - 1
    tokens = torch.zeros(B, n + 1, dtype=torch.long)
    target = torch.full((B, n + k + 1), -1, dtype=torch.long)
    hid3 = torch.zeros(B, n, items[0]["hid3"].shape[1])
    if rng is None:
        first = max(items[0]["n_prompt"] - 2, 0)  # draft 1 from anchor t is token t+2: answer tokens only
        anchor_list = [np.arange(first, max(len(items[0]["tokens"]) - 1, first + 1))]
    else:
        anchor_list = [rng.integers(0, max(len(item["tokens"]) - 1, 1), anchors_per_seq) for item in items]
    anchors = torch.as_tensor(np.stack(anchor_list), dtype=torch.long)  # (B, A)
    for b, item in enumerate(items):
        length = len(item["tokens"])
        tokens[b, :length] = item["tokens"]
        target[b, :length] = item["labels"]
        hid3[b, :length - 1] = item["hid3"][:length - 1].float()
    emb_real = embed[tokens[:, 1:n + 1]]
    real = target[:, 1:n + 1]                                                     # (B, n)
    depth = torch.arange(1, k).repeat(anchors.shape[1])                           # (A*m,)
    masked = torch.gather(target, 1, anchors.repeat_interleave(m, dim=1) + 1 + depth[None, :])  # (B, A*m)
    if rng is None:  # scoring: real rows only at the anchors, i.e. answer positions
        keep = torch.zeros_like(real, dtype=torch.bool)
        keep[:, anchors[0]] = True
        real = torch.where(keep, real, torch.full_like(real, -1))
    labels = torch.cat((real, masked), dim=1)
    draft_labels = torch.where(labels >= 0, t2d[labels.clamp(min=0)], torch.full_like(labels, -100))
    return emb_real, hid3, anchors, draft_labels


def _depth_of_rows(n: int, A: int, k: int):
    import torch

    return torch.cat((torch.zeros(n, dtype=torch.long), torch.arange(1, k).repeat(A)))  # (R,)


def train_peagle(args, argv: list[str], data: list[dict], target_state: dict, cfg: ModelConfig, out: Path,
                 eos_ids, aux: tuple[int, ...]) -> int:
    import torch

    k = args.parallel_k
    if not 1 <= k <= 16:
        raise ConfigError(f"--parallel-k must be in [1, 16], got {k}")
    identity = {"kind": "peagle", "draft_vocab": args.draft_vocab, "aux": list(aux), "k": k,
                "train_lm_head": args.train_lm_head}
    resume = load_resume(out, identity)
    draft_ids, t2d = draft_vocab_map(resume, data, cfg.vocab_size, args.draft_vocab, eos_ids)
    hcfg = eagle3.head_config_for(cfg, len(draft_ids), aux)
    module = build_module(hcfg, init_state(hcfg, target_state, draft_ids, args.seed, feature_std(data)))
    if not args.train_lm_head:  # keep the target's own output rows and final norm: less to overfit
        module.lm_head.weight.requires_grad_(False)
        module.norm.weight.requires_grad_(False)
    embed = target_state["model.embed_tokens.weight"]
    weights = [0.8 ** j for j in range(k)]
    eval_data, train_data = split(data)
    rng = np.random.default_rng(args.seed + (resume["step"] if resume is not None else 0))  # anchors

    def per_depth(items, sample):
        emb, hid, anchors, labels = _collate(items, t2d, embed, k, args.anchors, rng if sample else None)
        normed = module.train_forward(emb, hid, anchors, k)
        depth = _depth_of_rows(hid.shape[1], anchors.shape[1], k)
        for j in range(k):
            rows = normed[:, depth == j]   # (B, rows, H)
            lab = labels[:, depth == j]
            valid = lab != -100
            yield j, module.lm_head(rows[valid]), lab[valid]

    def batch_loss(items):
        losses = [weights[j] * torch.nn.functional.cross_entropy(logits, lab)
                  for j, logits, lab in per_depth(items, True) if lab.numel()]
        return sum(losses) / sum(weights)

    def evaluate() -> list[float]:
        """Top-1 agreement with the target per draft position on the held-out answers."""
        hits, total = np.zeros(k), np.zeros(k)
        for item in eval_data:
            for j, logits, lab in per_depth([item], False):
                hits[j] += (logits.argmax(-1) == lab).sum().item()
                total[j] += lab.numel()
        return list(hits / np.maximum(total, 1))

    def save(extra: dict) -> None:
        save_head(out, hcfg, dict(module.state_dict()), draft_ids, k, dtype=args.dtype, extra=extra)

    return fit(args=args, argv=argv, out=out, kind="peagle", module=module, identity=identity,
               resume=resume, draft_ids=draft_ids, train_data=train_data, batch_loss=batch_loss,
               evaluate=evaluate, save_head=save, n_sequences=len(data))
