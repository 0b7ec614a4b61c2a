"""What every backend shares: BackendError, the prefix-reuse rule (common_prefix), chunked prefill.

Prefix reuse across requests: a slot's `held` (ort_runner.OrtRunner.held[b], a drafter's view of it,
slot_views.SlotRunner.held) is the token ids whose rows 0..len(held)-1 its cache region holds validly (rows
beyond it are garbage). The caller that drives the cache keeps it (the speculative loop for the target, a
drafter for its own runner or head): () while a request runs, the fed sequence when it ended; so a request
that failed leaves () behind and the next one runs cold.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BackendError(RuntimeError):
    """A backend cannot load or run its graphs; the message says what to rebuild or change."""


def common_prefix(held: Sequence[int], ids: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of held and ids, at most limit."""
    n = min(len(held), len(ids), limit)
    i = 0
    while i < n and held[i] == ids[i]:
        i += 1
    return i


def resident_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zeroed array whose pages are all written now: np.zeros maps untouched pages that fault in on
    first use, which made the first request on a fresh batch slot slow."""
    array = np.empty(shape, dtype)
    array.fill(0)
    return array


def prefill_in_chunks(prefill_chunk_at, chunk: int, max_context: int, token_ids: Sequence[int],
                      position: int) -> np.ndarray:
    """All of token_ids at [position, ...) as prefill_chunk_at(part, position) calls of at most `chunk`
    tokens (a runner's prefill of one slot); the last token's logits (V,)."""
    n_tokens = len(token_ids)
    if n_tokens == 0:
        raise BackendError("prefill needs at least one token")
    if position < 0 or position + n_tokens > max_context:
        raise BackendError(f"positions [{position}, {position + n_tokens}) do not fit the {max_context}-token cache")
    logits = None
    for start in range(0, n_tokens, chunk):
        logits = prefill_chunk_at(token_ids[start:start + chunk], position + start)
    return logits
