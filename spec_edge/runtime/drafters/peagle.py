"""Parallel drafter (P-EAGLE style): an EAGLE-3-like head that drafts all k tokens in one pass.

Bookkeeping as in drafters/eagle3.py: the head's cache row p holds the pair (target hidden at p,
token p+1); `_ingested` counts the real pairs in it. Before drafting, the pairs verified since the
last call except the newest are fed in one ingest pass (none after a verify that accepted nothing
or a plain step); the newest pair (target hidden at last, pending token) is row 0 of the draft pass,
whose k-1 mask rows give drafts 2..k (spec_edge/heads/peagle.py). The pass writes only row 0 into the
cache, so rolling back is only moving `_ingested`.

Greedy and sampled picks over the draft vocabulary: drafters/head.py. The mask rows do not see the
sampled tokens, so each row is a proper q for its draft and speculative sampling stays exact.
"""
from __future__ import annotations

from spec_edge.config import ConfigError
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.head import CachedHeadDrafter
from spec_edge.runtime.sampling import Sampler


class PEagleDrafter(CachedHeadDrafter):
    """head: backends.ort_heads.OrtEagle3Head over a P-EAGLE export (draft graphs); columns (3Ht,):
    its three layers in the target's hidden rows."""
    name = "peagle"

    def check_k(self, k: int) -> None:
        if k not in self.head.draft_widths:
            raise ConfigError(f"k={k} has no P-EAGLE draft graph (exported for k in {self.head.draft_widths}): "
                              f"add {k} to graphs.k_values")

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        self.check_k(k)
        last = len(seq) - 2  # the newest real pair: (target hidden at last, pending token seq[-1])
        if last + k > self.head.max_context or last < self._ingested:  # no room / nothing new
            return None
        start, self._seq = self._ingested, seq
        hidden = self.hidden(start, last + 1)  # (last + 1 - start, n * Ht)
        if last > start:
            self.head.ingest(seq[start + 1:last + 1], hidden[:-1], start)
        logits = self.head.draft(seq[-1], hidden[-1:], last, k)  # (k, Vd)
        self._ingested = last + 1
        return self.draft_rows(logits, k, sampler)
