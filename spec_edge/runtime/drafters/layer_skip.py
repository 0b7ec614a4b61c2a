"""Layer-skip self-draft: the target's first N layers + its final norm + head.

It shares the target's weights and the cache of those N layers: the target's cache rows below the
pending position are exactly what these layers would compute, so drafting starts right away (no
catch-up, no prefill). Draft steps write rows >= that position, which the target's verify call
overwrites. An untrained early exit agrees with the full model rarely; it is here for exactness and
memory, and as the base a trained exit head would build on.
"""
from __future__ import annotations

from spec_edge.runtime.backends.slot_views import SlotRunner
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.sampling import Sampler


class LayerSkipDrafter:
    def __init__(self, runner: SlotRunner, n_layers: int):
        self.runner = runner  # target.layer_skip(n_layers)
        self.n_layers = n_layers
        self.name = f"layerskip{n_layers}"

    def check_k(self, k: int) -> None:  # any k: it proposes token by token
        pass

    def forget(self) -> None:  # its cache is the target's, which the loop records
        pass

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        position = len(seq) - 1  # the target's pending token
        if position + k > self.runner.max_context:
            return None
        if sampler.params.greedy:  # ids only: on TensorRT the chain and its argmax stay on the device
            return Draft.from_picks([(int(t), None) for t in self.runner.greedy_chain(seq[-1], position, k)])
        token, picks = seq[-1], []
        for i in range(k):
            picks.append(sampler.pick(self.runner.forward([token], position + i)[0]))
            token = picks[-1][0]
        return Draft.from_picks(picks)

    def finish(self) -> None:  # its cache is the target's, which the loop records
        pass

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass
