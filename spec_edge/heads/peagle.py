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

Training (spec-edge-train --kind peagle): spec_edge_training/peagle.py, its
train_forward (real rows + the mask rows of sampled anchors under one attention mask) over this module.
"""
from __future__ import annotations

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


# ---------------------------------------------------------------------------------------------
# The module (the draft graph and training share it; the ingest graph is EAGLE-3's)

def build_module(hcfg: HeadConfig, state: dict | None = None, width: int = 1):
    import torch
    from torch import nn

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

    return head_folder.load_state(PEagleHead(), state, "P-EAGLE head")
