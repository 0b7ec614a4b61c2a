"""Parallel drafter (P-EAGLE style): an EAGLE-3-like head that drafts all k tokens in one pass.

Bookkeeping as in drafters/eagle3.py: the head's cache row p holds the pair (target hidden at p,
token p+1); `_ingested` counts the real pairs in it. Before drafting, the pairs verified since the
last call except the newest are fed in one ingest pass (none after a verify that accepted nothing
or a plain step); the newest pair (target hidden at last, pending token) is row 0 of the draft pass,
whose k-1 mask rows give drafts 2..k (spec_edge/peagle.py). The pass writes only row 0 into the
cache, so rolling back is only moving `_ingested`.

Greedy: the argmax over the draft vocabulary, mapped to a target id. Sampling: each row's logits are
spread over the full target vocabulary (-inf outside the draft vocabulary) and sampled with the
request's sampler; the mask rows do not see the sampled tokens, so each row is a proper q for its
draft and speculative sampling stays exact.
"""
from __future__ import annotations

import numpy as np

from ..backends.base import Runner
from ..config import ConfigError
from ..speculative import Draft, Sampler


class PEagleDrafter:
    name = "peagle"

    def __init__(self, target: Runner, head, columns: np.ndarray | None = None):
        self.target = target    # must return hidden states (graphs exported with the head configured)
        self.head = head        # backends.ort_heads.OrtEagle3Head over a P-EAGLE export (draft graphs)
        self.columns = columns  # (3Ht,) columns of the head's three layers in the target's hidden rows
        self.draft_ids = head.draft_ids  # (Vd,) int64 draft id -> target id
        self._full = np.full(target.vocab_size, -np.inf, np.float32)  # (V,) reused logits row
        self._ingested = 0

    def check_k(self, k: int) -> None:
        if k not in self.head.draft_widths:
            raise ConfigError(f"k={k} has no P-EAGLE draft graph (exported for k in {self.head.draft_widths}): "
                              f"add {k} to graphs.k_values")

    def start(self, prompt_ids: list[int]) -> None:
        self._ingested = 0

    def _pick(self, logits: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        if sampler.params.greedy:
            return int(self.draft_ids[int(np.argmax(logits))]), None
        self._full[self.draft_ids] = logits
        return sampler.pick(self._full)

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        self.check_k(k)
        last = len(seq) - 2  # the newest real pair: (target hidden at last, pending token seq[-1])
        if last + k > self.head.max_context or last < self._ingested:  # no room / nothing new
            return None
        start = self._ingested
        hidden = self.target.hidden_states(start, last + 1)  # (last + 1 - start, n * Ht)
        if self.columns is not None:
            hidden = hidden[:, self.columns]
        if last > start:
            self.head.ingest(seq[start + 1:last + 1], hidden[:-1], start)
        logits = self.head.draft(seq[-1], hidden[-1:], last, k)  # (k, Vd)
        self._ingested = last + 1
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
