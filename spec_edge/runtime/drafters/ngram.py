"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
suffix (longest n-gram first). No model, so a draft costs nothing; a wasted verify call still
costs ~1.5 plain steps on the CPU, so the drafter proposes only while its matches have been paying
off: per match length it keeps the accepted tokens per proposal (with a prior) and stays silent
when that falls below the break-even point."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from spec_edge.runtime.drafters.base import Draft


@dataclass
class Gate:
    """Per key (a kind of match): accepted tokens per proposal so far, from an optimistic prior (each key is tried
    a few times); open(key) while that holds break_even, the accepted tokens per verify that beat a plain step."""
    break_even: float = 0.6
    prior_accepted: float = 2.0
    prior_proposals: float = 1.0
    _stats: dict[Hashable, list[float]] = field(default_factory=dict)  # key -> [accepted, proposals]

    def open(self, key: Hashable) -> bool:
        accepted, proposals = self._stats.get(key, (self.prior_accepted, self.prior_proposals))
        return accepted / proposals >= self.break_even

    def record(self, key: Hashable, n_accepted: int) -> None:
        stats = self._stats.setdefault(key, [self.prior_accepted, self.prior_proposals])
        stats[0] += n_accepted
        stats[1] += 1


@dataclass
class NgramDrafter:
    ngram_min: int = 2
    ngram_max: int = 4
    break_even: float = 0.6     # accepted tokens per verify needed to beat a plain step
    prior_accepted: float = 2.0  # optimistic prior: try each match length a few times
    prior_proposals: float = 1.0
    name: str = "ngram"
    _index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end position (latest)
    _indexed: int = 0           # n-grams ending at positions < _indexed are in _index
    _gate: Gate = field(default_factory=Gate)  # per match length n
    _last_n: int = 0

    def start(self, prompt_ids: list[int]) -> None:
        self._index.clear()
        self._indexed = 0
        self._gate = Gate(self.break_even, self.prior_accepted, self.prior_proposals)

    def _extend_index(self, seq: list[int]) -> None:
        # index n-grams ending before the last position, so a lookup never finds the suffix itself
        for end in range(max(self._indexed, 1), len(seq)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self._index[tuple(seq[end - n:end])] = end
        self._indexed = max(self._indexed, len(seq))

    def propose(self, seq: list[int], k: int, sampler=None) -> Draft | None:
        self._extend_index(seq)
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            end = self._index.get(tuple(seq[-n:]))
            if end is None:
                continue
            if not self._gate.open(n):
                return None
            tokens = seq[end:end + k]
            tokens += [tokens[-1]] * (k - len(tokens))  # verify width is fixed: pad a short match
            self._last_n = n
            return Draft(tokens=tokens, q_draft=None)
        return None

    def check_k(self, k: int) -> None:  # any k: a short match is padded
        pass

    def forget(self) -> None:  # nothing cached: the index is rebuilt from each prompt
        pass

    def finish(self) -> None:
        pass

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        self._gate.record(self._last_n, n_accepted)
