"""What the loop calls on a drafter (Drafter) and what a drafter proposes (Draft). In propose(seq, k, sampler)
seq is the whole sequence so far (prompt + generated); its last token is the target's pending token, not yet in
the target's cache (it sits at position len(seq) - 1); None: nothing worth verifying, take a plain step. seq is the
loop's own list of the request, extended in place until the request leaves (so at finish() it holds every token
chosen: drafters/suffix.py reads the answer's last tokens there); a drafter never changes it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from spec_edge.runtime.sampling import Sampler


@dataclass(frozen=True)
class Draft:
    tokens: list[int]             # k proposed ids
    q_draft: np.ndarray | None    # (k, V) drafter probabilities; None = greedy or deterministic

    @classmethod
    def from_picks(cls, picks: list[tuple[int, np.ndarray | None]]) -> Draft:
        """The Draft of k (token, q row) picks as Sampler.pick returns them (q None when greedy)."""
        q_rows = [q_row for _, q_row in picks if q_row is not None]
        return cls(tokens=[token for token, _ in picks], q_draft=np.stack(q_rows) if q_rows else None)


class Drafter(Protocol):
    """What the loops call on a drafter (every drafter and test double implements all of it; a method
    with nothing to do for a drafter is a no-op there)."""
    name: str

    def check_k(self, k: int) -> None: ...  # ConfigError unless it can propose k tokens (heads built for some k)

    def forget(self) -> None: ...  # before start(): ignore its cache's record, start cold (reuse=False)

    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None: ...

    def observe(self, n_proposed: int, n_accepted: int) -> None: ...

    def finish(self) -> None: ...  # the request ended normally: record what the drafter's cache holds
