"""EAGLE-3 drafter: a one-layer head over the target's own low/mid/high hidden states.

Bookkeeping: the head's cache row p holds the pair (target hidden at p, token p+1). `_ingested` is
the number of real pairs in it (rows 0.._ingested-1). Before drafting, the pairs the target has
verified since the last call are fed in one ingest pass (after a verify: the accepted drafts + the
target's own token, at most k+1 rows; after the prompt: the whole prompt in prefill-width chunks);
its last row gives draft 1. Drafts 2..k are [1, 1] steps on the head's own hidden state. Draft rows
are overwritten by the next ingest (rolling back is only moving `_ingested`).

Greedy requests take the head's greedy_chain (ingest + k-1 steps, argmax and d2t map); sampled picks
over the draft vocabulary: drafters/head.py.
"""
from __future__ import annotations

from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.head import CachedHeadDrafter
from spec_edge.runtime.sampling import Sampler


class Eagle3Drafter(CachedHeadDrafter):
    """head: backends.ort_heads.OrtEagle3Head; columns (3Ht,):
    its layers in the target's hidden rows."""
    name = "eagle3"

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        last = len(seq) - 2  # the newest real pair: (target hidden at last, pending token seq[-1])
        if last + k > self.head.max_context or last < self._ingested:  # no room / nothing new
            return None
        start, self._seq = self._ingested, seq
        if sampler.params.greedy:  # ids only
            ids = self.head.greedy_chain(seq[start + 1:last + 2], self.hidden(start, last + 1), start, k)
            self._ingested = last + 1
            return Draft.from_picks([(int(t), None) for t in ids])
        logits, own = self.head.ingest(seq[start + 1:last + 2], self.hidden(start, last + 1), start)
        self._ingested = last + 1
        picks = []
        for i in range(k):
            picks.append(self.pick(logits, sampler))
            if i < k - 1:
                logits, own = self.head.step(picks[-1][0], own, last + 1 + i)
        return Draft.from_picks(picks)
