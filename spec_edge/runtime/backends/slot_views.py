"""The slotted runner the loop drives (Slotted), and one slot of it or of a per-slot head seen through the
interface the drafters use.

The drafters (runtime/drafters/*.py) are written against one model cache: a SlotRunner for the
draft model and for the target's hidden states, an ONNX Runtime head (ort_heads.py) for EAGLE-3 /
P-EAGLE. Each slot's drafter gets views of its own slot, so the drafters run unchanged, each over its
slot's regions only (B=1: slot 0):

  SlotRunner(runner, b)   an ort_runner.OrtRunner (the target, or a draft model over B regions) seen
                          as slot b alone: forward / argmax / prefill / greedy_chain run one-row
                          calls on b's region, hidden_states reads b's rows, held is runner.held[b]
                          (the slot's prefix record)
  SlotHead(head, b)       an OrtEagle3Head(slots=B) as one head of slot b: ingest / step /
                          greedy_chain / draft on b's cache region; held is the slot's own record
                          (kept on the view, which the slot keeps across requests)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from spec_edge.runtime.backends.base import BackendError


class Slotted(Protocol):
    """What the loop (runtime/speculative.py) and the engine call on a target of B slots, each with its own
    cache region: ort_runner.OrtRunner."""
    batch: int                      # B
    step_width: int                 # 1, or 2: q4's two-row step
    max_context: int
    vocab_size: int
    prefill_chunk: int
    widths: frozenset[int]
    held: Sequence[tuple[int, ...]]  # (B,) the token ids each slot's region holds (prefix reuse)

    def check_width(self, width: int) -> None: ...

    def forward(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray: ...

    def argmax(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray: ...

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray: ...

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int, image_rows: np.ndarray | None = None,
                         image_mask: np.ndarray | None = None) -> np.ndarray: ...

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None: ...


class SlotRunner:
    """Slot `slot` of an ort_runner.OrtRunner alone: every call a one-row call on its cache region, at any of the
    runner's one-row widths (1 and each k+1). Calls write the keys/values of the tokens they process into the
    region at [position, position + n_tokens); nothing is removed: rolling back is calling again at an earlier
    position (rows >= position are masked inside the graph). held: the slot's prefix record (base.py)."""

    def __init__(self, runner, slot: int):
        if not 0 <= slot < runner.batch:
            raise BackendError(f"slot must be in [0, {runner.batch}), got {slot}")
        self.runner, self.slot = runner, slot
        self.max_context = runner.max_context      # S
        self.vocab_size = runner.vocab_size        # V
        self.prefill_chunk = runner.prefill_chunk  # C
        self.widths: frozenset[int] = runner.single_widths  # T of every one-row step / verify graph

    @property
    def held(self) -> tuple[int, ...]:
        return self.runner.held[self.slot]

    @held.setter
    def held(self, ids: tuple[int, ...]) -> None:
        self.runner.held[self.slot] = ids

    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Logits (T, V) of the slot's one-row call (a view, valid until the next call of that width)."""
        self.check_width(len(token_ids))
        return self.runner.forward([self.slot], np.asarray([token_ids], np.int64), [position])[0]

    def argmax(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """The greedy token after each position, (T,) int64 (only T ids leave the runner)."""
        self.check_width(len(token_ids))
        return self.runner.argmax([self.slot], np.asarray([token_ids], np.int64), [position])[0]

    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """token_ids at [position, ...) in prefill chunks of C; the last token's logits (V,)."""
        return self.runner.prefill(self.slot, token_ids, position)

    def greedy_chain(self, token: int, position: int, n: int) -> np.ndarray:
        """n greedy tokens, (n,) int64: the argmax after `token` at `position`, then after each of those in turn;
        the cache gets token and the first n-1 of them."""
        out = []
        for i in range(n):
            token = int(self.argmax([token], position + i)[0])
            out.append(token)
        return np.asarray(out, np.int64)

    def hidden_states(self, start: int, stop: int) -> np.ndarray:
        """EAGLE-3: the target's low/mid/high-layer hidden states (stop - start, 3 * hidden) of the positions
        [start, stop) the latest calls processed (a view, valid until a call rewrites them); only for graphs
        exported with an EAGLE-3 head configured (OrtRunner.hidden_states refuses others)."""
        return self.runner.hidden_states(self.slot, start, stop)

    def layer_skip(self, n_layers: int) -> SlotRunner:
        """The slot's layer-skip self-drafter: the first n_layers + final norm + head over this slot's region,
        sharing the target's weights (OrtRunner.layer_skip)."""
        return SlotRunner(self.runner.layer_skip(n_layers), self.slot)

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no graph of width {width} (k={width - 1}); this model was exported for "
                               f"k in {ks}: re-export with graphs.k_values including {width - 1}")


class SlotHead:
    """Slot `slot` of an OrtEagle3Head(slots=B), as drafters/eagle3.py, peagle.py and hybrid.py use a head."""

    def __init__(self, head, slot: int):
        if not 0 <= slot < head.slots:
            raise BackendError(f"head slot must be in [0, {head.slots}), got {slot}")
        self.head, self.slot = head, slot
        self.held: tuple[int, ...] = ()  # this slot's record (drafters/head.py: CachedHeadDrafter)
        self.cfg, self.head_dir, self.draft_ids = head.cfg, head.head_dir, head.draft_ids
        self.max_context = head.max_context
        self.ingest_widths, self.draft_widths = head.ingest_widths, head.draft_widths

    def ingest(self, tokens: Sequence[int], hidden: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        return self.head.ingest(tokens, hidden, position, self.slot)

    def step(self, token: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        return self.head.step(token, hidden, position, self.slot)

    def greedy_chain(self, tokens: Sequence[int], hidden: np.ndarray, position: int, k: int) -> np.ndarray:
        return self.head.greedy_chain(tokens, hidden, position, k, self.slot)

    def draft(self, token: int, hidden: np.ndarray, position: int, k: int) -> np.ndarray:
        return self.head.draft(token, hidden, position, k, self.slot)
