"""spec-edge-train --kind peagle: a parallel-drafting P-EAGLE head (spec_edge/heads/peagle.py).

Per batch: all real pairs of a sequence (draft 1 at every position) plus, for --anchors sampled
positions per sequence, k-1 mask rows that see the real pairs up to their anchor and the anchor's
earlier mask rows (one attention mask over real + mask rows, as P-EAGLE trains: the head's
train_forward; the rows and labels from _collate), the loss on the target's argmax (decayed by 0.8
per position). The held-out score is the top-1 agreement per draft position with every answer
position an anchor. The loop is fit.fit; the head is saved as a P-EAGLE folder (heads.peagle.save_head).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads.eagle3 import HeadConfig
from spec_edge.heads.peagle import build_module, save_head
from spec_edge_training import eagle3 as eagle3_training
from spec_edge_training.data import feature_std
from spec_edge_training.fit import draft_vocab_map, fit, load_resume, split


def init_state(hcfg: HeadConfig, target_state: dict, draft_ids: np.ndarray, seed: int = 0,
               feature_std=None) -> dict:
    """EAGLE-3's fresh head + mask_embed (the target's mean token embedding) and a small random
    mask_hidden."""
    import torch

    state = eagle3_training.init_state(hcfg, target_state, draft_ids, seed, feature_std)
    gen = torch.Generator().manual_seed(seed + 1)
    state["mask_embed"] = target_state["model.embed_tokens.weight"].float().mean(0).clone()
    state["mask_hidden"] = torch.randn(hcfg.hidden_size, generator=gen) * 0.02
    return state


def train_forward(module, hcfg: HeadConfig, emb_real, hid3, anchors, k: int):
    """The head (heads/peagle.build_module) over real rows + the mask rows of sampled anchors under one
    attention mask. emb_real (B, n, H): embedding of token t+1 for real row t; hid3 (B, n, 3Ht);
    anchors (B, A) int64 in [0, n). Returns normed states (B, n + A*(k-1), H): real rows,
    then per anchor its k-1 mask rows (mask row j of anchor t sits at position t+j)."""
    import torch

    from spec_edge.graphs.model import rotate_half

    attn = module.midlayer.self_attn
    B, n = hid3.shape[:2]
    A, m = anchors.shape[1], k - 1
    H = hcfg.hidden_size
    nh, nkv, hd = hcfg.n_heads, hcfg.n_kv_heads, hcfg.head_dim
    R = n + A * m
    h = torch.cat((module.fuse(hid3), module.mask_hidden.expand(B, A * m, H)), dim=1)  # (B, R, H)
    emb = torch.cat((emb_real, module.mask_embed.expand(B, A * m, H)), dim=1)     # (B, R, H)
    depth = torch.arange(1, k).repeat(A)                                        # (A*m,)
    group = torch.arange(A).repeat_interleave(m)                                # (A*m,)
    anchor_row = anchors.repeat_interleave(m, dim=1)                            # (B, A*m)
    pos = torch.cat((torch.arange(n).expand(B, n), anchor_row + depth[None, :]), dim=1).float()
    allowed = torch.zeros(B, R, R, dtype=torch.bool)
    allowed[:, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[:, n:, :n] = torch.arange(n)[None, None, :] <= anchor_row[:, :, None]
    allowed[:, n:, n:] = (group[:, None] == group[None, :]) & (depth[None, :] <= depth[:, None])
    freqs = pos[..., None] * module.inv_freq                                      # (B, R, D/2)
    rot = torch.cat((freqs, freqs), dim=-1)[:, None]                            # (B, 1, R, D)
    cos, sin = rot.cos(), rot.sin()
    x, residual = module.layer_inputs(emb, h)
    q = attn.q_proj(x).view(B, R, nh, hd).transpose(1, 2)    # (B, nh, R, D)
    kk = attn.k_proj(x).view(B, R, nkv, hd).transpose(1, 2)  # (B, nkv, R, D)
    v = attn.v_proj(x).view(B, R, nkv, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    kk = kk * cos + rotate_half(kk) * sin
    kk = kk.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(q, kk.transpose(-1, -2)) / math.sqrt(hd)     # (B, nh, R, R)
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)             # (B, nh, R, D)
    out = out.transpose(1, 2).reshape(B, R, nh * hd)
    h = residual + attn.o_proj(out)
    h = h + module.midlayer.mlp(module.midlayer.post_attention_layernorm(h))
    return module.norm(h)


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
    hcfg = eagle3_training.head_config_for(cfg, len(draft_ids), aux)
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
        normed = train_forward(module, hcfg, emb, hid, anchors, k)
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
