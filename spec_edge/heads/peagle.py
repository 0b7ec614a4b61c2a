"""Parallel drafting in the P-EAGLE style: an EAGLE-3-like head that drafts all k tokens in ONE pass.

The head is EAGLE-3's (spec_edge/heads/eagle3.py: fc over the target's three hidden states, one decoder
layer over [embed(token) ; hidden] with its own KV cache, norm, lm_head over the draft vocabulary,
d2t) plus two learned vectors (H,): mask_embed, the token embedding of a position whose token is not
known yet, and mask_hidden, its placeholder hidden state (in the head's H space, after fc).

Cache rows as in EAGLE-3: row p holds the pair (target hidden at p, token p+1). After a verify the
pairs before the newest are ingested (EAGLE-3's ingest graphs, width <= k); then one draft pass of
width k at position `last` (the newest pair's row):

    row 0:        [embed(pending token) ; fc(target hidden at last)]   -> logits of draft 1
    rows 1..k-1:  [mask_embed ; mask_hidden] at positions last+1 ..   -> logits of drafts 2..k
    causal attention over the head's cache (rows < last) and these k rows

Row 0's K/V is a real pair and is written into the cache; the placeholder rows are not. So the
drafter costs one [1, k] pass (plus an ingest pass when the verify accepted drafts), instead of
EAGLE-3's k sequential steps.

Graphs (static; S = max context, W = width, V = target vocab, Vd = draft vocab):
    eagle3_ingest_<W>:  EAGLE-3's ingest graph (the same module and weights)
    peagle_draft_<k>:   tokens (1, 1), hidden (1, 3Ht), position (1,), k_cache / v_cache (1, Hkv, S, D),
                        embed_table (V, H) -> logits (k, Vd), k_new / v_new (1, Hkv, k, D)

Layout: an EAGLE-3 head folder (SafeAILab names, eagle_config) + tensors mask_embed, mask_hidden and
config "parallel_drafting": {"k": the draft width it was trained for}.

Training (spec-edge train-draft --kind peagle): spec_edge_training/peagle.py, through the module's
train_forward (real rows + the mask rows of sampled anchors under one attention mask).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads import eagle3, head_folder
from spec_edge.heads.eagle3 import HeadConfig

HEAD_FORMAT = 1
MASK_TENSORS = ("mask_embed", "mask_hidden")


# ---------------------------------------------------------------------------------------------
# Checkpoint

def load_head(path: str | Path, target: ModelConfig) -> tuple[HeadConfig, dict, np.ndarray]:
    """(config, float32 state, draft ids (Vd,)) of a P-EAGLE head folder, checked against the target."""
    hcfg, state, draft_ids = eagle3.load_head(path, target)
    missing = [name for name in MASK_TENSORS if name not in state]
    if missing:
        raise ConfigError(f"'{path}' is not a parallel-drafting (P-EAGLE) head: it has no {' / '.join(missing)} "
                          f"tensors (an EAGLE-3 head runs with drafter eagle3)")
    for name in MASK_TENSORS:
        if tuple(state[name].shape) != (hcfg.hidden_size,):
            raise ConfigError(f"P-EAGLE head '{path}': {name} is {tuple(state[name].shape)}, "
                              f"the head's hidden size is {hcfg.hidden_size}")
    return hcfg, state, draft_ids


def save_head(path: str | Path, hcfg: HeadConfig, state: dict, draft_ids: np.ndarray, parallel_k: int,
              dtype: str = "float16", extra: dict | None = None) -> Path:
    return eagle3.save_head(path, hcfg, state, draft_ids, dtype=dtype, extra=extra, more_tensors=MASK_TENSORS,
                            more_config={"architectures": ["LlamaForCausalLMPEagle"],
                                         "parallel_drafting": {"k": parallel_k}})


def init_state(hcfg: HeadConfig, target_state: dict, draft_ids: np.ndarray, seed: int = 0,
               feature_std=None) -> dict:
    """EAGLE-3's fresh head + mask_embed (the target's mean token embedding) and a small random
    mask_hidden."""
    import torch

    state = eagle3.init_state(hcfg, target_state, draft_ids, seed, feature_std)
    gen = torch.Generator().manual_seed(seed + 1)
    state["mask_embed"] = target_state["model.embed_tokens.weight"].float().mean(0).clone()
    state["mask_hidden"] = torch.randn(hcfg.hidden_size, generator=gen) * 0.02
    return state


# ---------------------------------------------------------------------------------------------
# The module (the draft graph and training share it; the ingest graph is EAGLE-3's)

def build_module(hcfg: HeadConfig, state: dict | None = None, width: int = 1):
    import torch
    from torch import nn

    from spec_edge.graphs.model import rotate_half

    class PEagleHead(eagle3.head_class(hcfg)):
        """forward(tokens (1, 1), hidden (1, 3Ht), position, k_cache, v_cache, embed_table)
        -> logits (width, Vd), k_new, v_new (1, Hkv, width, D)."""

        def __init__(self):
            super().__init__()
            self.mask_embed = nn.Parameter(torch.zeros(hcfg.hidden_size))
            self.mask_hidden = nn.Parameter(torch.zeros(hcfg.hidden_size))
            self.width = width  # k: static in the exported graph

        def forward(self, tokens, hidden, position, k_cache, v_cache, embed_table):
            seq = self.width
            emb = torch.index_select(embed_table, 0, tokens[0])  # (1, H)
            h = self.fuse(hidden)                                # (1, H)
            if seq > 1:
                emb = torch.cat((emb, self.mask_embed[None, :].expand(seq - 1, -1)), dim=0)  # (k, H)
                h = torch.cat((h, self.mask_hidden[None, :].expand(seq - 1, -1)), dim=0)     # (k, H)
            h, k_new, v_new = self.layer(emb, h, position, k_cache, v_cache, seq)
            logits = self.lm_head(self.norm(h)).float()  # (k, Vd)
            return logits, k_new[None], v_new[None]

        # -- training: real rows + mask rows of sampled anchors, one attention mask
        def train_forward(self, emb_real, hid3, anchors, k: int):
            """emb_real (B, n, H): embedding of token t+1 for real row t; hid3 (B, n, 3Ht);
            anchors (B, A) int64 in [0, n). Returns normed states (B, n + A*(k-1), H): real rows,
            then per anchor its k-1 mask rows (mask row j of anchor t sits at position t+j)."""
            attn = self.midlayer.self_attn
            B, n = hid3.shape[:2]
            A, m = anchors.shape[1], k - 1
            H = hcfg.hidden_size
            nh, nkv, hd = hcfg.n_heads, hcfg.n_kv_heads, hcfg.head_dim
            R = n + A * m
            h = torch.cat((self.fuse(hid3), self.mask_hidden.expand(B, A * m, H)), dim=1)  # (B, R, H)
            emb = torch.cat((emb_real, self.mask_embed.expand(B, A * m, H)), dim=1)     # (B, R, H)
            depth = torch.arange(1, k).repeat(A)                                        # (A*m,)
            group = torch.arange(A).repeat_interleave(m)                                # (A*m,)
            anchor_row = anchors.repeat_interleave(m, dim=1)                            # (B, A*m)
            pos = torch.cat((torch.arange(n).expand(B, n), anchor_row + depth[None, :]), dim=1).float()
            allowed = torch.zeros(B, R, R, dtype=torch.bool)
            allowed[:, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[:, n:, :n] = torch.arange(n)[None, None, :] <= anchor_row[:, :, None]
            allowed[:, n:, n:] = (group[:, None] == group[None, :]) & (depth[None, :] <= depth[:, None])
            freqs = pos[..., None] * self.inv_freq                                      # (B, R, D/2)
            rot = torch.cat((freqs, freqs), dim=-1)[:, None]                            # (B, 1, R, D)
            cos, sin = rot.cos(), rot.sin()
            x, residual = self.layer_inputs(emb, h)
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
            h = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
            return self.norm(h)

    return head_folder.load_state(PEagleHead(), state, "P-EAGLE head")
