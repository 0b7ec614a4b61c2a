"""EAGLE-3 drafter: a one-layer head over the target's own low/mid/high hidden states.

Bookkeeping: the head's cache row p holds the pair (target hidden at p, token p+1). `_ingested` is
the number of real pairs in it (rows 0.._ingested-1). Before drafting, the pairs the target has
verified since the last call are fed in one ingest pass (after a verify: the accepted drafts + the
target's own token, at most k+1 rows; after the prompt: the whole prompt in prefill-width chunks);
its last row gives draft 1. Drafts 2..k are [1, 1] steps on the head's own hidden state. Draft rows
are overwritten by the next ingest (rolling back is only moving `_ingested`).

Greedy: the argmax over the draft vocabulary, mapped to a target id. Sampling: the draft logits are
spread over the full target vocabulary (-inf outside the draft vocabulary) and sampled with the
request's sampler, so q_draft is a proper (k, V) distribution and speculative sampling keeps the
target's distribution exactly.
"""
from __future__ import annotations

import numpy as np

from ..backends.base import Runner
from ..speculative import Draft, Sampler


class Eagle3Drafter:
    name = "eagle3"

    def __init__(self, target: Runner, head, columns: np.ndarray | None = None):
        self.target = target    # must return hidden states (graphs exported with the head configured)
        self.head = head        # backends.ort_heads.OrtEagle3Head
        self.columns = columns  # (3Ht,) the head's layers in the target's hidden rows (None = all)
        self.draft_ids = head.draft_ids  # (Vd,) int64 draft id -> target id
        self._full = np.full(target.vocab_size, -np.inf, np.float32)  # (V,) reused logits row
        self._ingested = 0

    def start(self, prompt_ids: list[int]) -> None:
        self._ingested = 0

    def _pick(self, logits: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        if sampler.params.greedy:
            return int(self.draft_ids[int(np.argmax(logits))]), None
        self._full[self.draft_ids] = logits
        return sampler.pick(self._full)

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        last = len(seq) - 2  # the newest real pair: (target hidden at last, pending token seq[-1])
        if last + k > self.head.max_context or last < self._ingested:  # no room / nothing new
            return None
        start = self._ingested
        hidden = self.target.hidden_states(start, last + 1)
        if self.columns is not None:
            hidden = hidden[:, self.columns]
        logits, own = self.head.ingest(seq[start + 1:last + 2], hidden, start)
        self._ingested = last + 1
        tokens: list[int] = []
        q_rows: list[np.ndarray] = []
        for i in range(k):
            token, q_row = self._pick(logits, sampler)
            tokens.append(token)
            if q_row is not None:
                q_rows.append(q_row)
            if i < k - 1:
                logits, own = self.head.step(token, own, last + 1 + i)
        return Draft(tokens=tokens, q_draft=np.stack(q_rows) if q_rows else None)

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass
