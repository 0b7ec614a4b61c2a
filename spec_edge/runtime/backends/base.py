"""The one-model interface the drafters use: one model's static graphs around one resident KV cache.

A Runner is one slot of a model (target or draft): its cache region and the graphs exported for it
(slot_views.SlotRunner over ort_runner.OrtRunner, whose slotted calls the loop drives; B=1 is slot 0):
  prefill  (1, C)    tokens -> logits of the last real token
  step     (1, 1)    one token -> its logits
  verify   (1, k+1)  k+1 tokens -> logits at every position
Every call writes the keys/values of the tokens it processes into the cache at
[position, position + n_tokens). Nothing is ever removed: rolling back is calling again at an
earlier position, and cache rows >= position are masked out inside the graph.

Prefix reuse across requests: `held` is the token ids whose rows 0..len(held)-1 the cache holds
validly (rows beyond it are garbage). The caller that drives the cache keeps it (the speculative
loop for the target, a drafter for its own runner or head): () while a request runs, the fed
sequence when it ended; so a request that failed leaves () behind and the next one runs cold.
"""
from __future__ import annotations

import abc
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


class Runner(abc.ABC):
    held: tuple[int, ...] = ()  # token ids of the cache rows that are valid (prefix reuse); see above
    max_context: int       # cache length S
    vocab_size: int        # V
    prefill_chunk: int     # C
    widths: frozenset[int]  # T of every step/verify graph (1 and each k+1)

    @abc.abstractmethod
    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Run the width-len(token_ids) graph at `position`; returns logits (T, V) float32."""

    @abc.abstractmethod
    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Run the prefill graph over token_ids in chunks of C; returns the last token's logits (V,)."""

    def argmax(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Greedy token after each position, (T,) int64. Device backends override this so only
        T ids cross to the host instead of T x V logits."""
        return np.argmax(self.forward(token_ids, position), axis=-1)

    def greedy_chain(self, token: int, position: int, n: int) -> np.ndarray:
        """n greedy tokens, (n,) int64: the argmax after `token` at `position`, then after each of
        those in turn; the cache gets token and the first n-1 of them. Device backends override this
        so the chain runs on the device and only the n ids cross to the host, once."""
        out = []
        for i in range(n):
            token = int(self.argmax([token], position + i)[0])
            out.append(token)
        return np.asarray(out, np.int64)

    @abc.abstractmethod
    def layer_skip(self, n_layers: int) -> "Runner":
        """A runner over the first n_layers of this model + final norm + head that shares this
        runner's weights and the cache of those layers (the layer-skip self-drafter)."""

    def hidden_states(self, start: int, stop: int) -> np.ndarray:
        """EAGLE-3: the target's low/mid/high-layer hidden states (stop - start, 3 * hidden) of the
        positions [start, stop) the latest calls processed (a view; valid until the next call
        rewrites those positions). Only for graphs exported with an EAGLE-3 head configured."""
        raise BackendError(f"{type(self).__name__} does not return hidden states (needed by the eagle3 drafter)")

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no graph of width {width} (k={width - 1}); this model was exported for "
                               f"k in {ks}: re-export with graphs.k_values including {width - 1}")

    def check_room(self, position: int, n_tokens: int) -> None:
        if position < 0 or position + n_tokens > self.max_context:
            raise BackendError(f"positions [{position}, {position + n_tokens}) do not fit the "
                               f"{self.max_context}-token cache")
