"""Medusa drafter: n heads on the target's final-norm hidden state, all drafts from one pass.

The hidden state at the last verified position (len(seq) - 2, whose argmax is the pending token
seq[-1]) goes through the heads' graph once; head i gives draft i (k <= n heads). No draft cache, so
nothing to roll back. The target graphs return that hidden state (spec_edge/heads/medusa.py: index L of
target_hidden_layers) for every position they process, prefill included.

Greedy and sampled picks over the draft vocabulary: drafters/head.py.
"""
from __future__ import annotations

from spec_edge.config import ConfigError
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.head import HeadDrafter
from spec_edge.runtime.sampling import Sampler


class MedusaDrafter(HeadDrafter):
    """head: backends.ort_heads.OrtMedusaHeads; columns (H,): the final-norm state in the target's
    hidden rows. No draft cache: nothing to roll back."""
    name = "medusa"

    def check_k(self, k: int) -> None:
        if not 1 <= k <= self.head.n_heads:
            raise ConfigError(f"k={k} needs {k} Medusa heads; the heads in {self.head.head_dir} have "
                              f"{self.head.n_heads}: use k <= {self.head.n_heads} or train more heads "
                              f"(spec-edge-train --kind medusa --medusa-heads {k})")

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None:
        self.check_k(k)
        last = len(seq) - 2  # the target's hidden state here chose the pending token seq[-1]
        if last < 0:
            return None
        logits = self.head.run(self.hidden(last, last + 1))  # (n, Vd)
        return self.draft_rows(logits, k, sampler)
