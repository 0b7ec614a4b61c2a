"""The slotted runner the loop drives (Slotted), and one slot of it or of a per-slot head seen through the
interface the drafters use.

The drafters (runtime/drafters/*.py) are written against one model cache: a Runner (base.py) for the
draft model and for the target's hidden states, an ONNX Runtime head (ort_heads.py) for EAGLE-3 /
P-EAGLE. In the batched node each slot's drafter gets views of its own slot instead, so the drafters
run unchanged, each over its slot's regions only:

  SlotRunner(runner, b)   a BatchRunner (ort_batch.py: the batched target, or a draft model's B=1
                          export over B regions) as a B=1 Runner of slot b: forward / argmax /
                          prefill / greedy_chain run one-row calls on b's region, hidden_states reads
                          b's rows, held is runner.held[b] (the slot's prefix record)
  SlotHead(head, b)       an OrtEagle3Head(slots=B) as one head of slot b: ingest / step /
                          greedy_chain / draft on b's cache region; held is the slot's own record
                          (kept on the view, which the slot keeps across requests)

And the other way round, for the one loop (runtime/speculative.py) over a B=1 target:

  OneSlot(runner)         a B=1 Runner as a slotted runner of one slot (graphs.batch_slots = 1: one
                          request is one occupied slot); its slot 0 is the Runner itself (slot_views)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from spec_edge.runtime.backends.base import BackendError, Runner


class Slotted(Protocol):
    """What the loop (runtime/speculative.py) and the engine call on a target of B slots, each with its own
    cache region: ort_batch.BatchRunner, or OneSlot over a B=1 Runner."""
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

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int) -> np.ndarray: ...

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None: ...


class SlotRunner(Runner):
    """Slot `slot` of a BatchRunner as a B=1 Runner (every call a one-row call on its region)."""

    def __init__(self, runner, slot: int):
        if not 0 <= slot < runner.batch:
            raise BackendError(f"slot must be in [0, {runner.batch}), got {slot}")
        self.runner, self.slot = runner, slot
        self.max_context = runner.max_context
        self.vocab_size = runner.vocab_size
        self.prefill_chunk = runner.prefill_chunk
        self.widths = runner.widths

    @property
    def held(self) -> tuple[int, ...]:
        return self.runner.held[self.slot]

    @held.setter
    def held(self, ids: tuple[int, ...]) -> None:
        self.runner.held[self.slot] = ids

    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Logits (T, V) of the slot's one-row call (a view, valid until the next call of that width)."""
        return self.runner.forward([self.slot], np.asarray([token_ids], np.int64), [position])[0]

    def argmax(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        return self.runner.argmax([self.slot], np.asarray([token_ids], np.int64), [position])[0]

    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        return self.runner.prefill(self.slot, token_ids, position)

    def hidden_states(self, start: int, stop: int) -> np.ndarray:
        return self.runner.hidden_states(self.slot, start, stop)

    def layer_skip(self, n_layers: int) -> Runner:
        """The slot's layer-skip self-drafter: the first n_layers over this slot's region (BatchRunner.layer_skip)."""
        return SlotRunner(self.runner.layer_skip(n_layers), self.slot)


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


class _OneHeld:
    """The one-slot held list of a OneSlot: item 0 is the wrapped Runner's held."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def __len__(self) -> int:
        return 1

    def __getitem__(self, slot: int) -> tuple[int, ...]:
        _check_slot(slot)
        return self.runner.held

    def __setitem__(self, slot: int, ids: tuple[int, ...]) -> None:
        _check_slot(slot)
        self.runner.held = tuple(ids)


def _check_slot(slot: int) -> None:
    if slot != 0:
        raise BackendError(f"a one-slot runner has slot 0 only, got {slot}")


class OneSlot:
    """A B=1 Runner as a batch runner of one slot (the interface runtime/speculative.py's loop drives): a
    call names slot 0, every call is the Runner's own call at that width; held[0] is runner.held."""

    batch = 1
    step_width = 1  # the Runner's width-1 step (q4's B=1 step graph computes its two rows itself)

    def __init__(self, runner: Runner):
        self.runner = runner
        self.max_context = runner.max_context
        self.vocab_size = runner.vocab_size
        self.prefill_chunk = runner.prefill_chunk
        self.widths = runner.widths

    @property
    def held(self) -> _OneHeld:
        return _OneHeld(self.runner)

    @held.setter
    def held(self, records: Sequence[tuple[int, ...]]) -> None:
        (self.runner.held,) = records

    def check_width(self, width: int) -> None:
        self.runner.check_width(width)

    def forward(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        """Logits (1, T, V) of the Runner's call over tokens (1, T) at positions[0]."""
        (slot,), (position,) = slots, positions
        _check_slot(slot)
        return self.runner.forward([int(t) for t in tokens[0]], int(position))[None]

    def argmax(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        (slot,), (position,) = slots, positions
        _check_slot(slot)
        return np.asarray(self.runner.argmax([int(t) for t in tokens[0]], int(position)))[None]

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int) -> np.ndarray:
        _check_slot(slot)
        return self.runner.prefill(list(part), position)

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray:
        _check_slot(slot)
        return self.runner.prefill(list(token_ids), position)

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None:
        _check_slot(source)
        _check_slot(target)  # one slot: nothing to copy
