"""Medusa drafter: n heads on the target's final-norm hidden state, all drafts from one pass.

The hidden state at the last verified position (len(seq) - 2, whose argmax is the pending token
seq[-1]) goes through the heads' graph once; head i gives draft i (k <= n heads). No draft cache, so
nothing to roll back. The target graphs return that hidden state (spec_edge/medusa.py: index L of
target_hidden_layers) for every position they process, prefill included.

Greedy: the argmax over the draft vocabulary, mapped to a target id. Sampling: each head's logits are
spread over the full target vocabulary (-inf outside the draft vocabulary) and sampled with the
request's sampler, so q_draft is the (k, V) distribution each draft was drawn from and speculative
sampling keeps the target's distribution exactly.
"""
from __future__ import annotations

import numpy as np

from ..backends.base import Runner
from ..config import ConfigError
from ..speculative import Draft, Sampler


class MedusaDrafter:
    name = "medusa"

    def __init__(self, target: Runner, heads, columns: np.ndarray | None = None):
        self.target = target    # must return hidden states (graphs exported with the heads configured)
        self.heads = heads      # backends.ort_heads.OrtMedusaHeads
        self.columns = columns  # (H,) columns of the final-norm state in the target's hidden rows
        self.draft_ids = heads.draft_ids  # (Vd,) int64 draft id -> target id
        self._full = np.full(target.vocab_size, -np.inf, np.float32)  # (V,) reused logits row

    def check_k(self, k: int) -> None:
        if not 1 <= k <= self.heads.n_heads:
            raise ConfigError(f"k={k} needs {k} Medusa heads; the heads in {self.heads.head_dir} have "
                              f"{self.heads.n_heads}: use k <= {self.heads.n_heads} or train more heads "
                              f"(spec-edge train-draft --kind medusa --medusa-heads {k})")

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def _pick(self, logits: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        if sampler.params.greedy:
            return int(self.draft_ids[int(np.argmax(logits))]), None
        self._full[self.draft_ids] = logits
        return sampler.pick(self._full)

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        self.check_k(k)
        last = len(seq) - 2  # the target's hidden state here chose the pending token seq[-1]
        if last < 0:
            return None
        hidden = self.target.hidden_states(last, last + 1)  # (1, n * H)
        if self.columns is not None:
            hidden = hidden[:, self.columns]
        logits = self.heads.run(hidden)  # (n, Vd)
        tokens: list[int] = []
        q_rows: list[np.ndarray] = []
        for i in range(k):
            token, q_row = self._pick(logits[i], sampler)
            tokens.append(token)
            if q_row is not None:
                q_rows.append(q_row)
        return Draft(tokens=tokens, q_draft=np.stack(q_rows) if q_rows else None)

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass
