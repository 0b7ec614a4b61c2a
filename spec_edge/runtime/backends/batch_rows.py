"""The rows of one call of the batched dynamic graph (graphs/batch_dynamic.py), shared by its two runners
(trt_batch.TensorRTBatchRunner on the device, ort_batch_dynamic.OrtBatchDynamicRunner on the CPU).

The contract both implement (the CPU BatchRunner's):
  forward(slots, tokens (m, T), positions (m,)) -> logits (m, T, V)   only those m slots run
  argmax(slots, tokens, positions) -> (m, T)                          ids only
A decode call runs rows [0, n) = slots [0, n) of the cache (the graph's cache input is the block of
the first n slots, bound by address), so n >= max(slot) + 1; a row whose slot is not in the call is
an idle row (token 0 at position 0; its new rows and logits are dropped). RowCount picks n per width:
it grows at once and shrinks only after SHRINK_AFTER calls in a row needed fewer rows, because each
new n is a new input shape (on TensorRT an eager call and a new CUDA graph), and the BatchLoop's
step / verify calls change their highest slot often (an idle row costs one slot's cache read).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from spec_edge.runtime.backends.base import BackendError

SHRINK_AFTER = 16  # calls in a row that needed fewer rows before a width's n shrinks


class RowCount:
    """The rows n one width's context runs; see the module docstring."""

    def __init__(self, most: int, shrink_after: int = SHRINK_AFTER):
        self.most, self.shrink_after = most, shrink_after
        self.n, self._fewer = 0, 0

    def rows_for(self, need: int) -> int:
        if not 1 <= need <= self.most:
            raise BackendError(f"a call needs {need} rows, the engine runs 1..{self.most}")
        if need > self.n:
            self.n, self._fewer = need, 0
        elif need < self.n:
            self._fewer += 1
            if self._fewer >= self.shrink_after:
                self.n, self._fewer = need, 0
        else:
            self._fewer = 0
        return self.n


@dataclass(frozen=True)
class CallRows:
    """One decode call: n rows = slots [0, n); the requested slots' rows carry their tokens and positions."""
    n: int
    slots: tuple[int, ...]   # the requested slots, in the caller's order (= their rows)
    tokens: np.ndarray       # (n, T) int64, idle rows 0
    positions: np.ndarray    # (n,) int64, idle rows 0
    active: np.ndarray       # (n,) bool: the row's new keys/values (and hidden rows) are written


def check_call(batch: int, max_context: int, widths: Collection[int], slots: Sequence[int], tokens,
               positions: Sequence[int]) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """(slots, tokens (m, T) int64, positions (m,) int64) of a valid call; BackendError saying what is wrong."""
    slots = tuple(int(s) for s in slots)
    tokens = np.asarray(tokens, np.int64)
    positions = np.asarray(positions, np.int64).reshape(-1)
    if not slots:
        raise BackendError("a batched call needs at least one slot")
    if len(set(slots)) != len(slots) or not all(0 <= s < batch for s in slots):
        raise BackendError(f"slots {list(slots)}: each at most once, in [0, {batch})")
    if tokens.ndim != 2 or tokens.shape[0] != len(slots) or positions.shape != (len(slots),):
        raise BackendError(f"{len(slots)} slots need tokens ({len(slots)}, T) and positions ({len(slots)},), got "
                           f"{tokens.shape} and {positions.shape}")
    width = tokens.shape[1]
    if width not in widths:
        ks = sorted(w - 1 for w in widths if w > 1)
        raise BackendError(f"no batched engine profile of width {width} (k={width - 1}); built for k in {ks}: "
                           f"rebuild with graphs.k_values including {width - 1}")
    for slot, pos in zip(slots, positions):
        if pos < 0 or pos + width > max_context:
            raise BackendError(f"slot {slot}: positions [{pos}, {pos + width}) do not fit the "
                               f"{max_context}-token cache")
    return slots, tokens, positions


def plan_call(slots: tuple[int, ...], tokens: np.ndarray, positions: np.ndarray, n: int) -> CallRows:
    """The n-row call of check_call's values (n > max(slots))."""
    width = tokens.shape[1]
    rows_tokens = np.zeros((n, width), np.int64)
    rows_positions = np.zeros((n,), np.int64)
    active = np.zeros((n,), bool)
    index = list(slots)
    rows_tokens[index] = tokens
    rows_positions[index] = positions
    active[index] = True
    return CallRows(n, slots, rows_tokens, rows_positions, active)


def store_targets(call: CallRows, n_kv: int, max_context: int, batch: int, spare_step: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each row's new rows go in the flat stores of trt_batch.cache_store, (n,) int64 each: the key /
    value row of head h, token t is dest + step h + t; the hidden row of token t is hdest + t. A called
    slot r: (r Hkv + h) S + position + t, r S + position + t (its own region); an idle row: the spare rows
    after the B regions (batch Hkv S + h spare_step + t, batch S + t), which nothing reads."""
    rows = np.arange(call.n)
    dest = np.where(call.active, rows * n_kv * max_context + call.positions, batch * n_kv * max_context)
    step = np.where(call.active, max_context, spare_step)
    hdest = np.where(call.active, rows * max_context + call.positions, batch * max_context)
    return dest.astype(np.int64), step.astype(np.int64), hdest.astype(np.int64)


def check_chunk(batch: int, max_context: int, chunk: int, slot: int, part: Sequence[int], position: int) -> None:
    """A prefill chunk: 1..C tokens into one slot at position."""
    if not 0 <= slot < batch:
        raise BackendError(f"slot {slot} is not in [0, {batch})")
    if not 1 <= len(part) <= chunk:
        raise BackendError(f"a prefill chunk holds 1..{chunk} tokens, got {len(part)}")
    if position < 0 or position + len(part) > max_context:
        raise BackendError(f"slot {slot}: positions [{position}, {position + len(part)}) do not fit the "
                           f"{max_context}-token cache")
