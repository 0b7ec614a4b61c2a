"""Medusa heads: several extra heads on the target's last hidden state, no draft KV cache.

Input: h, the target's hidden state after its final norm (what feeds its lm_head) at the position
whose argmax is the pending token. Head i (1-based) predicts the token i positions after the pending
one, so one pass over h gives drafts d1..dn at once:

    head i:  r_i = h + SiLU(W_i h + b_i)     (a ResBlock, medusa_num_layers of them in sequence)
             logits_i = U_i r_i              U_i (Vd, H): over the reduced draft vocabulary
    draft ids map to target ids: target_id = draft_id + d2t[draft_id]  (EAGLE-3's offset form)

Graph (static): medusa_<n>: hidden (1, H) -> logits (n, Vd), all heads in one pass.

Checkpoint layout (FasterDecoding/Medusa tensor names, so published full-vocabulary Medusa-1 heads
load too): config.json with medusa_num_heads, medusa_num_layers, hidden_size, vocab_size,
draft_vocab_size, target_num_hidden_layers; model.safetensors with
medusa_head.{i}.{j}.linear.weight / .bias (ResBlock j of head i), medusa_head.{i}.{L}.weight (the
output rows), d2t (Vd,) offsets and t2d (V,) bool.

Training (spec-edge-train --kind medusa): spec_edge_training/medusa.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads import head_folder

HEAD_FORMAT = 1


@dataclass(frozen=True)
class MedusaConfig:
    n_heads: int                 # n: drafts per pass (k <= n)
    hidden_size: int             # H: the target's
    target_vocab_size: int       # V
    draft_vocab_size: int        # Vd
    n_layers: int = 1            # ResBlocks per head
    target_layers: int = 0       # layer count of the target it was made for (0 = not recorded)


def parameter_names(mcfg: MedusaConfig) -> list[str]:
    names = []
    for i in range(mcfg.n_heads):
        for j in range(mcfg.n_layers):
            names += [f"medusa_head.{i}.{j}.linear.weight", f"medusa_head.{i}.{j}.linear.bias"]
        names.append(f"medusa_head.{i}.{mcfg.n_layers}.weight")
    return names


# ---------------------------------------------------------------------------------------------
# Checkpoint reading / writing

def check_heads(mcfg: MedusaConfig, state: dict, target: ModelConfig, where: str = "Medusa head") -> None:
    """Refuse heads that do not fit the target, naming the mismatch."""
    problems = []
    if mcfg.n_heads < 1:
        problems.append(f"medusa_num_heads is {mcfg.n_heads}")
    if mcfg.hidden_size != target.hidden_size:
        problems.append(f"head hidden size {mcfg.hidden_size} differs from the target's {target.hidden_size}: "
                        f"the heads were trained for another model")
    problems += head_folder.target_problems(mcfg.target_vocab_size, mcfg.target_layers, target, "heads were")
    if not problems:
        missing = [name for name in parameter_names(mcfg) if name not in state]
        if missing:
            problems.append(f"tensors missing: {missing[:4]}")
    if not problems:
        for i in range(mcfg.n_heads):
            linear = state[f"medusa_head.{i}.0.linear.weight"]
            out = state[f"medusa_head.{i}.{mcfg.n_layers}.weight"]
            if tuple(linear.shape) != (mcfg.hidden_size, mcfg.hidden_size):
                problems.append(f"head {i} ResBlock is {tuple(linear.shape)}, not {mcfg.hidden_size} x {mcfg.hidden_size} "
                                f"(hidden size of the target)")
                break
            if tuple(out.shape) != (mcfg.draft_vocab_size, mcfg.hidden_size):
                problems.append(f"head {i} output is {tuple(out.shape)}, draft_vocab_size x hidden is "
                                f"({mcfg.draft_vocab_size}, {mcfg.hidden_size})")
                break
    if not problems:
        problems += head_folder.d2t_problems(state.get("d2t"), mcfg.draft_vocab_size, mcfg.target_vocab_size,
                                             target.vocab_size, earlier=False)
    head_folder.refuse(problems, where, target)


def load_heads(path: str | Path, target: ModelConfig) -> tuple[MedusaConfig, dict, np.ndarray]:
    """(config, float32 state dict, draft-to-target id map (Vd,) int64) of a Medusa folder, checked
    against the target."""
    path = Path(path).expanduser()
    raw = head_folder.read_config(path, "Medusa head", "spec-edge-train --kind medusa")
    if "medusa_num_heads" not in raw:
        raise ConfigError(f"'{path}' is not a Medusa head: its config.json has no medusa_num_heads")
    # medusa_lm_head.pt: FasterDecoding's own file name
    state = head_folder.read_tensors(path, "Medusa head", ("medusa_lm_head.pt", "pytorch_model.bin"))
    n_heads, n_layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    out = state.get(f"medusa_head.0.{n_layers}.weight")
    linear = state.get("medusa_head.0.0.linear.weight")
    hidden = int(raw.get("hidden_size") or (linear.shape[1] if linear is not None else 0))
    vocab = int(raw.get("vocab_size") or (out.shape[0] if out is not None else 0))
    mcfg = MedusaConfig(n_heads=n_heads, hidden_size=hidden, target_vocab_size=vocab,
                        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab), n_layers=n_layers,
                        target_layers=int(raw.get("target_num_hidden_layers", 0)))
    check_heads(mcfg, state, target, f"Medusa head '{path}'")
    draft_ids = head_folder.draft_ids_of(state.get("d2t"), mcfg.draft_vocab_size)
    float_state = {name: state[name].float() for name in parameter_names(mcfg)}
    return mcfg, float_state, draft_ids


def save_heads(path: str | Path, mcfg: MedusaConfig, state: dict, draft_ids: np.ndarray,
               dtype: str = "float16", extra: dict | None = None) -> Path:
    """Write a Medusa folder (FasterDecoding tensor names + EAGLE-3's d2t / t2d)."""
    config = {"architectures": ["MedusaHeads"], "medusa_num_heads": mcfg.n_heads,
              "medusa_num_layers": mcfg.n_layers, "hidden_size": mcfg.hidden_size,
              "vocab_size": mcfg.target_vocab_size, "draft_vocab_size": mcfg.draft_vocab_size,
              "target_num_hidden_layers": mcfg.target_layers, "torch_dtype": dtype,
              "spec_edge": dict(format=HEAD_FORMAT, **(extra or {}))}
    return head_folder.write(path, state, parameter_names(mcfg), draft_ids, mcfg.target_vocab_size, dtype, config)


def head_fingerprint(path: str | Path) -> str:
    return head_folder.fingerprint(path, (".json", ".safetensors", ".bin", ".pt"), ("train_state.pt", "train_data.pt"))


# ---------------------------------------------------------------------------------------------
# The heads as a torch module (export and training share it)

def build_module(mcfg: MedusaConfig, state: dict | None = None):
    import torch
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(mcfg.hidden_size, mcfg.hidden_size)

        def forward(self, x):
            return x + nn.functional.silu(self.linear(x))

    class MedusaHeads(nn.Module):
        """forward(hidden (1, H)) -> logits (n, Vd); heads(h (R, H)) -> n x (R, Vd)."""

        def __init__(self):
            super().__init__()
            self.medusa_head = nn.ModuleList(
                nn.Sequential(*[ResBlock() for _ in range(mcfg.n_layers)],
                              nn.Linear(mcfg.hidden_size, mcfg.draft_vocab_size, bias=False))
                for _ in range(mcfg.n_heads))

        def heads(self, hidden):
            return [head(hidden) for head in self.medusa_head]

        def forward(self, hidden):
            return torch.cat(self.heads(hidden), dim=0).float()  # (n, Vd)

    return head_folder.load_state(MedusaHeads(), state, "Medusa head")


def read_config(out_dir: Path) -> MedusaConfig:
    return MedusaConfig(**json.loads((Path(out_dir) / "head.json").read_text()))
