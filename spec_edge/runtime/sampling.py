"""Pure functions: turning logits into tokens, and the speculative acceptance rules.

Greedy: a draft token is accepted while it equals the target's argmax; the first disagreement is
replaced by the target's token, and when all k agree the target's (k+1)-th token is a free bonus.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x ~ q_draft is accepted with
probability min(1, p_target(x) / q_draft(x)); on rejection the replacement is drawn from the
normalised residual max(0, p_target - q_draft). The emitted tokens then follow p_target exactly.
A deterministic drafter (n-gram lookup) is a one-hot q_draft: accept with p_target(x), resample
from p_target with x removed.

The target's distribution at a position is that of its processed logits (processed_logits): the raw
logits with, in this order, the repetition penalty (every token id in the prompt or the generated
history: a positive logit divided by it, a negative one multiplied, as CTRL / llama.cpp / vLLM), the
frequency and presence penalties (generated history only, as OpenAI / vLLM: logit -= frequency * count +
presence * [count > 0]), the logit bias (added) and the suppressed ids (ignore_eos: the EOS ids at -inf,
as llama.cpp); then probabilities() applies temperature, top-k, top-p and min-p (ids below min_p times
the top probability dropped, after temperature). The history of a row is the prompt, the tokens emitted
before it and, in a verify window [pending, d1..dm], the drafts d1..di before row i: exactly what
target-only decoding has seen at that position. Greedy is the argmax of the processed logits (min_p,
top-k and top-p never drop the argmax). Log-probabilities (token_logprobs) are the log-softmax of the
processed logits, before temperature / top-k / top-p / min-p.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    min_p: float = 0.0        # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    suppressed: tuple[int, ...] = ()  # ids whose logits are -inf (ignore_eos: the EOS ids)
    logprobs: int = 0         # report each emitted token's log-probability and its row's top N (0 = none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether processed_logits changes the logits (penalties, bias, suppressed ids)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or bool(self.suppressed))


def processed_logits(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
                     window: Sequence[int] = ()) -> np.ndarray:
    """(N, V) logits rows -> (N, V) processed logits (the module docstring's order); row i's history is the
    prompt, generated and window[:i] (N <= len(window) + 1). The input itself when nothing is processed."""
    if not params.processes:
        return logits
    out = np.array(logits, dtype=np.float64)  # (N, V), a copy
    vocab = out.shape[-1]
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=vocab).astype(np.float64)  # (V,)
    in_prompt = np.zeros(vocab, dtype=bool)
    in_prompt[np.asarray(prompt, dtype=np.int64)] = True
    bias = np.zeros(vocab)
    for token, value in params.logit_bias:
        bias[token] += value
    for i in range(out.shape[0]):
        if i:
            counts[window[i - 1]] += 1.0
        row = out[i]
        if params.repetition_penalty != 1.0:
            seen = in_prompt | (counts > 0)
            row[seen] = np.where(row[seen] > 0, row[seen] / params.repetition_penalty,
                                 row[seen] * params.repetition_penalty)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        row += bias
        row[list(params.suppressed)] = -np.inf
    return out


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
    if params.min_p > 0.0:  # always keeps the top token
        probs = np.where(probs >= params.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the top-N of its row (log-softmax of the processed logits)."""
    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def as_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top_ids": list(self.top_ids),
                "top_logprobs": list(self.top_logprobs)}


def token_logprobs(processed: np.ndarray, tokens: Sequence[int], n: int) -> list[TokenLogprobs]:
    """tokens[i] chosen from processed row i ((len(tokens), V) processed logits): its log-probability and
    the n most likely ids of the row (highest first, ties: lower id first). Only allowed ids are listed: an id
    the row forbids (-inf: a grammar's mask, ignore_eos) has no log-probability to report, so a row with fewer
    than n allowed ids lists fewer; every number is finite (JSON has no -Infinity)."""
    given = np.asarray(processed)[:len(tokens)]  # (N, V)
    rows = given.astype(np.float64)
    top = rows.max(axis=-1, keepdims=True)
    logp = rows - (top + np.log(np.exp(rows - top).sum(axis=-1, keepdims=True)))  # (N, V)
    vocab = logp.shape[-1]
    # the row's order is the logits' own (one constant apart): partition them as given (float32: faster)
    best = np.argpartition(-given, n, axis=-1)[:, :n] if n < vocab else np.tile(np.arange(vocab), (len(rows), 1))
    out = []
    for row, ids, token in zip(logp, best, tokens):
        ids = ids[np.lexsort((ids, -row[ids]))]  # highest first, ties: lower id first
        ids = ids[np.isfinite(row[ids])]
        out.append(TokenLogprobs(int(token), float(row[token]), tuple(int(i) for i in ids),
                                 tuple(float(row[i]) for i in ids)))
    return out


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


class Sampler:
    """Chooses tokens from logits with the request's sampling parameters and random stream; prompt: the
    request's prompt ids (the repetition penalty's history)."""

    def __init__(self, params: SamplingParams, seed: int | None = None, prompt: Sequence[int] = ()):
        self.params = params
        self.rng = np.random.default_rng(seed)
        self.prompt = tuple(prompt)

    def process(self, logits: np.ndarray, generated: Sequence[int], window: Sequence[int] = ()) -> np.ndarray:
        """(N, V) target logits rows -> the processed rows the request chooses from (sampling.processed_logits:
        row i's history is the prompt, generated and window[:i])."""
        return processed_logits(logits, self.params, self.prompt, generated, window)

    def pick(self, logits_row: np.ndarray) -> tuple[int, np.ndarray | None]:
        """(token, probabilities row or None when greedy) for a (V,) logits row (already processed: a
        drafter's own rows are picked as they are)."""
        if self.params.greedy:
            return int(np.argmax(logits_row)), None
        probs = probabilities(logits_row[None, :], self.params)[0]
        return sample(probs, self.rng), probs
