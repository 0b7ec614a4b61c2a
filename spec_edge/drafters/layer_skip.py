"""Layer-skip self-draft: the target's first N layers + its final norm + head.

It shares the target's weights and the cache of those N layers: the target's cache rows below the
pending position are exactly what these layers would compute, so drafting starts right away (no
catch-up, no prefill). Draft steps write rows >= that position, which the target's verify call
overwrites. An untrained early exit agrees with the full model rarely; it is here for exactness and
memory, and as the base a trained exit head would build on.
"""
from __future__ import annotations

import numpy as np

from ..backends.base import Runner
from ..speculative import Draft, Sampler


class LayerSkipDrafter:
    def __init__(self, runner: Runner, n_layers: int):
        self.runner = runner  # target.layer_skip(n_layers)
        self.n_layers = n_layers
        self.name = f"layerskip{n_layers}"

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        position = len(seq) - 1  # the target's pending token
        if position + k > self.runner.max_context:
            return None
        token = seq[-1]
        tokens: list[int] = []
        q_rows: list[np.ndarray] = []
        for i in range(k):
            logits = self.runner.forward([token], position + i)[0]
            token, q_row = sampler.pick(logits)
            tokens.append(token)
            if q_row is not None:
                q_rows.append(q_row)
        return Draft(tokens=tokens, q_draft=np.stack(q_rows) if q_rows else None)

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass
