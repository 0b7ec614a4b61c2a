"""A separate, smaller draft model run through the same backend, with its own KV cache.

The drafter remembers which tokens its cache holds (`_fed`, positions 0..len-1). Before drafting
it feeds whatever of the sequence it has not seen (usually the target's correction token, or the
last draft + bonus token after a full acceptance), then drafts k tokens one [1, 1] step each.
Rejected drafts need no cleanup: the next call overwrites those positions.
"""
from __future__ import annotations

from spec_edge.runtime.backends.base import Runner
from spec_edge.runtime.speculative import Draft, Sampler


class ModelDrafter:
    def __init__(self, runner: Runner, name: str = "draft"):
        self.runner = runner
        self.name = name
        self._fed: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        self._fed = list(prompt_ids)
        self.runner.prefill(self._fed, 0)

    def _common_prefix(self, seq: list[int]) -> int:
        n = min(len(self._fed), len(seq))
        i = 0
        while i < n and self._fed[i] == seq[i]:
            i += 1
        return i

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        common = self._common_prefix(seq)
        del self._fed[common:]
        if len(seq) + k > self.runner.max_context:
            return None
        logits = None
        for token in seq[common:]:
            logits = self.runner.forward([token], len(self._fed))[0]
            self._fed.append(token)
        if logits is None:  # nothing new to condition on (cannot happen in the loop: guard only)
            return None
        picks = []
        for i in range(k):
            picks.append(sampler.pick(logits))
            if i < k - 1:
                token = picks[-1][0]
                logits = self.runner.forward([token], len(self._fed))[0]
                self._fed.append(token)
        return Draft.from_picks(picks)

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass
