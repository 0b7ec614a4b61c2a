"""A separate, smaller draft model run through the same backend, with its own KV cache.

The drafter remembers which tokens its cache holds (`_fed`, positions 0..len-1). Before drafting
it feeds whatever of the sequence it has not seen (usually the target's correction token, or the
last draft + bonus token after a full acceptance), then drafts k tokens one [1, 1] step each.
Greedy requests take ids only (SlotRunner.greedy_chain: on TensorRT the argmax and the chain run on the
device, one copy of k ids per draft); sampling needs each step's logits row on the host.
Rejected drafts need no cleanup: the next call overwrites those positions.

Across requests the runner's `held` keeps `_fed` (set in finish()): a prompt sharing a prefix with
it prefills only the rest (no logits are needed here, so the whole prompt may be reused).
"""
from __future__ import annotations

from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.backends.slot_views import SlotRunner
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.sampling import Sampler


class ModelDrafter:
    def __init__(self, runner: SlotRunner, name: str = "draft"):
        self.runner = runner
        self.name = name
        self._fed: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        kept = common_prefix(self.runner.held, prompt_ids, len(prompt_ids))
        self.runner.held = ()  # until finish(): a failed request leaves the next one cold
        if kept < len(prompt_ids):
            self.runner.prefill(prompt_ids[kept:], kept)
        self._fed = list(prompt_ids)

    def check_k(self, k: int) -> None:  # any k: the draft model proposes token by token
        pass

    def forget(self) -> None:
        self.runner.held = ()

    def finish(self) -> None:
        self.runner.held = tuple(self._fed)

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        common = common_prefix(self._fed, seq, len(seq))
        del self._fed[common:]
        if len(seq) + k > self.runner.max_context:
            return None
        if common == len(seq):  # nothing new to condition on (cannot happen in the loop: guard only)
            return None
        if sampler.params.greedy:  # ids only: on TensorRT the chain and its argmax stay on the device
            for token in seq[common:-1]:
                self.runner.argmax([token], len(self._fed))
                self._fed.append(token)
            drafts = self.runner.greedy_chain(seq[-1], len(self._fed), k)
            self._fed += [seq[-1]] + [int(t) for t in drafts[:k - 1]]
            return Draft.from_picks([(int(t), None) for t in drafts])
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
