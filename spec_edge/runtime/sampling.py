"""Pure functions: turning logits into tokens, and the speculative acceptance rules.

Greedy: a draft token is accepted while it equals the target's argmax; the first disagreement is
replaced by the target's token, and when all k agree the target's (k+1)-th token is a free bonus.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x ~ q_draft is accepted with
probability min(1, p_target(x) / q_draft(x)); on rejection the replacement is drawn from the
normalised residual max(0, p_target - q_draft). The emitted tokens then follow p_target exactly.
A deterministic drafter (n-gram lookup) is a one-hot q_draft: accept with p_target(x), resample
from p_target with x removed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """(N, V) logits -> (N, V) float64 probabilities after temperature, top-k and top-p."""
    scaled = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        cumulative = np.cumsum(sorted_probs, axis=-1)
        keep_sorted = (cumulative - sorted_probs) < params.top_p  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs_row: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (V,) probability row."""
    cumulative = np.cumsum(probs_row)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"),
                   len(probs_row) - 1))


def greedy_accept(target_ids: np.ndarray, draft_ids: list[int]) -> tuple[int, int]:
    """(n_accepted, next_token) from the target's argmax at k+1 positions and k drafts."""
    n_accepted = 0
    for draft in draft_ids:
        if int(target_ids[n_accepted]) != draft:
            break
        n_accepted += 1
    return n_accepted, int(target_ids[n_accepted])


def speculative_accept(p_target: np.ndarray, q_draft: np.ndarray | None, draft_ids: list[int],
                       rng: np.random.Generator) -> tuple[int, int]:
    """(n_accepted, next_token) by speculative sampling.

    p_target (k+1, V): target probabilities at each verified position; q_draft (k, V) the
    drafter's probabilities for its drafts, or None for a deterministic (one-hot) drafter.
    """
    for i, draft in enumerate(draft_ids):
        p_x = p_target[i, draft]
        q_x = 1.0 if q_draft is None else q_draft[i, draft]
        if q_x > 0 and rng.random() * q_x < p_x:  # accept with min(1, p_x / q_x)
            continue
        if q_draft is None:
            residual = p_target[i].copy()
            residual[draft] = 0.0
        else:
            residual = np.maximum(p_target[i] - q_draft[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: nothing to correct towards
            residual = p_target[i]
        return i, sample(residual, rng)
    k = len(draft_ids)
    return k, sample(p_target[k], rng)
