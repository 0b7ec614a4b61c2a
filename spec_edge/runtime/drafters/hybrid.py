"""Hybrid: a model-free lookup first, the EAGLE-3 head otherwise.

Each step asks the lookup (speculative.hybrid_lookup: the n-gram drafter, drafters/ngram.py, or the
suffix drafter, drafters/suffix.py) first: when the sequence's suffix has a match of a kind that has
been paying off, its copy is the draft (free to make, often long runs of accepted tokens on edits,
code, quoted text and repeated answers). Otherwise the EAGLE-3 head (drafters/eagle3.py) drafts. The
verify outcome goes to whichever of the two proposed the draft, so the lookup keeps adapting its
gate only from its own drafts.

The head needs no bookkeeping here: its cache holds the pairs it has ingested (`_ingested`), and
its next propose feeds every pair the target has verified since then in one ingest call (chunked
by the widest ingest graph), however many steps the n-gram drafter (or plain steps) took meanwhile.

Drafts keep their source's form: the lookup's draft is deterministic (q_draft None, one-hot under
speculative sampling), the head's carries its (k, V) q rows when sampling. Which source drafts
depends only on the sequence so far, so speculative sampling keeps the target's distribution.
"""
from __future__ import annotations

from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.sampling import Sampler


class HybridDrafter:
    name = "hybrid"

    def __init__(self, lookup, head):
        self.lookup = lookup    # drafters.ngram.NgramDrafter or drafters.suffix.SuffixDrafter
        self.head = head        # drafters.eagle3.Eagle3Drafter
        self._last = None       # the drafter whose draft is being verified
        self.proposals = {lookup.name: 0, "eagle3": 0}  # drafts per source in the current request

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.start(prompt_ids)
        self.head.start(prompt_ids)
        self._last = None
        self.proposals = {self.lookup.name: 0, "eagle3": 0}

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        self._last = None
        for source, key in ((self.lookup, self.lookup.name), (self.head, "eagle3")):
            draft = source.propose(seq, k, sampler)
            if draft is not None:
                self._last = source
                self.proposals[key] += 1
                return draft
        return None

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(n_proposed, n_accepted)

    def check_k(self, k: int) -> None:
        self.lookup.check_k(k)
        self.head.check_k(k)

    def forget(self) -> None:
        self.lookup.forget()
        self.head.forget()

    def finish(self) -> None:
        self.lookup.finish()
        self.head.finish()
