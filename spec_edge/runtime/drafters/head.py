"""What the drafters over the target's own hidden states share (EAGLE-3, P-EAGLE, Medusa).

The head's graphs come with its draft vocabulary (`head.draft_ids`, (Vd,) draft id -> target id).
Greedy: the argmax over the draft vocabulary, mapped to a target id. Sampling: the draft logits are
spread over the full target vocabulary (-inf outside the draft vocabulary) and sampled with the
request's sampler, so each q row is a proper (V,) distribution and speculative sampling keeps the
target's distribution exactly.
"""
from __future__ import annotations

import numpy as np

from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.backends.slot_views import SlotRunner
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.sampling import Sampler


class HeadDrafter:
    name = "head"

    def __init__(self, target: SlotRunner, head, columns: np.ndarray | None = None):
        self.target = target    # must return hidden states (graphs exported with the head configured)
        self.head = head        # a backends.ort_heads head: draft_ids, its graphs
        self.columns = columns  # the head's layers in the target's hidden rows (None = all)
        self.draft_ids = head.draft_ids  # (Vd,) int64 draft id -> target id
        self._full = np.full(target.vocab_size, -np.inf, np.float32)  # (V,) reused logits row
        self._ingested = 0      # real pairs in the head's cache (heads with a cache)

    def start(self, prompt_ids: list[int]) -> None:
        self._ingested = 0

    def check_k(self, k: int) -> None:  # any k (heads built for some k only override this)
        pass

    def forget(self) -> None:  # no cache of its own (heads with one override this)
        pass

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def hidden(self, start: int, stop: int) -> np.ndarray:
        """The target's hidden-state rows start..stop-1, the head's columns only."""
        hidden = self.target.hidden_states(start, stop)
        return hidden if self.columns is None else hidden[:, self.columns]

    def pick(self, logits: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
        """(target id, q row or None when greedy) from one row of draft-vocabulary logits."""
        if sampler.params.greedy:
            return int(self.draft_ids[int(np.argmax(logits))]), None
        self._full[self.draft_ids] = logits
        return sampler.pick(self._full)

    def draft_rows(self, logits: np.ndarray, k: int, sampler: Sampler) -> Draft:
        """The Draft of the first k rows of (rows, Vd) logits, one draft per row."""
        return Draft.from_picks([self.pick(logits[i], sampler) for i in range(k)])


class CachedHeadDrafter(HeadDrafter):
    """A head with a cache of its own (EAGLE-3, P-EAGLE): row p holds the pair (target hidden at p,
    token p+1), so rows 0.._ingested-1 are valid for exactly the ids seq[:_ingested + 1]. Across
    requests `head.held` keeps those ids (set in finish()); a prompt sharing a prefix with them
    starts with those pairs ingested (the target's hidden rows there are the same tokens' too)."""

    def start(self, prompt_ids: list[int]) -> None:
        self._ingested = max(0, common_prefix(self.head.held, prompt_ids, len(prompt_ids)) - 1)
        self.head.held = ()  # until finish(): a failed request leaves the next one cold
        self._seq = prompt_ids

    def forget(self) -> None:
        self.head.held = ()

    def finish(self) -> None:
        self.head.held = tuple(self._seq[:self._ingested + 1]) if self._ingested else ()
