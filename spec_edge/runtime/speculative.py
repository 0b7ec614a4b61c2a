"""The speculative loop: draft k, verify k+1 in one target call, accept, correct. Fixed k.

Invariant: the target's cache holds seq[:pos] and seq[pos] (= seq[-1]) is the pending token, the
last one chosen and not yet fed. One iteration feeds [pending, d1..dk] at positions pos..pos+k,
accepts n drafts, appends d1..dn and the target's own next token, and moves pos by n + 1. Rows
written for rejected drafts stay in the cache, masked by position until they are overwritten:
rolling back is only moving pos.

Without a drafter (or when the drafter has nothing worth verifying, or the verify window no longer
fits the cache) an iteration is a plain [1, 1] step. Target-only decoding is this same loop with
no drafter, so greedy speculative output equals it token for token.

Prefix reuse (reuse=True): the cache keeps what the last request left in it (`target.held`, the
ids of rows 0..pos-1 as it ended). A prompt sharing a prefix with those ids prefills only the rest,
from the first differing position; at least the last prompt token is prefilled (its logits choose
the first token). Drafters with a cache of their own do the same in start() and record theirs in
finish().
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from spec_edge.runtime.backends.base import Runner, common_prefix
from spec_edge.runtime.grammar import Constraint, mask_logits, mask_probs
from spec_edge.runtime.sampling import SamplingParams, greedy_accept, probabilities, sample, speculative_accept


@dataclass(frozen=True)
class Draft:
    tokens: list[int]             # k proposed ids
    q_draft: np.ndarray | None    # (k, V) drafter probabilities; None = greedy or deterministic

    @classmethod
    def from_picks(cls, picks: list[tuple[int, np.ndarray | None]]) -> Draft:
        """The Draft of k (token, q row) picks as Sampler.pick returns them (q None when greedy)."""
        q_rows = [q_row for _, q_row in picks if q_row is not None]
        return cls(tokens=[token for token, _ in picks], q_draft=np.stack(q_rows) if q_rows else None)


class Sampler:
    """Chooses tokens from logits with the request's sampling parameters and random stream."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        self.rng = np.random.default_rng(seed)

    def pick(self, logits_row: np.ndarray) -> tuple[int, np.ndarray | None]:
        """(token, probabilities row or None when greedy) for a (V,) logits row."""
        if self.params.greedy:
            return int(np.argmax(logits_row)), None
        probs = probabilities(logits_row[None, :], self.params)[0]
        return sample(probs, self.rng), probs


class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, seq: list[int], k: int, sampler: Sampler) -> Draft | None: ...

    def observe(self, n_proposed: int, n_accepted: int) -> None: ...

    # optional (test doubles may lack them); drafters with a cache of their own keep a record of it:
    def forget(self) -> None: ...  # before start(): ignore the record, start cold (reuse=False)

    def finish(self) -> None: ...  # the request ended normally: record what the drafter's cache holds


@dataclass
class Stats:
    drafter: str = "none"
    k: int = 0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # prompt rows kept from the previous request (not prefilled)
    new_tokens: int = 0
    drafted: int = 0               # draft tokens sent to verify
    accepted: int = 0              # of those, accepted
    forced: int = 0                # guided: draft tokens the grammar forced (no drafter asked)
    cut: int = 0                   # guided: draft tokens dropped before verify (the grammar forbids them)
    verify_calls: int = 0
    step_calls: int = 0            # plain [1, 1] target steps (no proposal, or no room)
    accepted_at: list[int] = field(default_factory=list)  # [i]: verifies whose draft i+1 was accepted (len k)
    # [i]: verify calls that could carry i+1 drafts (the k the load policy chose for the call; len k)
    verify_calls_by_k: list[int] = field(default_factory=list)
    policy_off_steps: int = 0      # plain steps where the load policy chose k = 0 (batched node; in step_calls)
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0     # verify + step calls (prefill excluded)
    draft_time_s: float = 0.0
    total_time_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify call (accepted drafts + the target's own token)."""
        return (self.accepted + self.verify_calls) / self.verify_calls if self.verify_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens after the first over the time after the first token."""
        decode = self.total_time_s - self.time_to_first_token_s
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i]: the share of the verify calls that could carry draft i+1 (k >= i+1) that accepted it."""
        reach = [sum(self.verify_calls_by_k[i:]) for i in range(len(self.accepted_at))]
        return [n / calls if calls else 0.0 for n, calls in zip(self.accepted_at, reach)] if self.verify_calls else []

    def verified(self, k: int, drafted: int, accepted: int) -> None:
        """Count one verify call that could carry k drafts, carried `drafted` and accepted `accepted`."""
        self.verify_calls += 1
        self.verify_calls_by_k[k - 1] += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "acceptance_per_position"):
            out[name] = getattr(self, name)
        return out


# emit(new_tokens) -> True to stop (a stop string was found); cancel() -> None or a finish reason
Emit = Callable[[list[int]], bool]
Cancel = Callable[[], "str | None"]


def take_chunk(new_tokens: list[int], chunk: list[int], eos, max_new_tokens: int) -> tuple[list[int], str | None]:
    """Append chosen tokens to new_tokens up to the first EOS (not kept) or max_new_tokens; returns
    (the part appended, "eos" | "length" | None). Shared by this loop and runtime/batch.py's slots."""
    reason = None
    for i, token in enumerate(chunk):
        if token in eos:
            chunk, reason = chunk[:i], "eos"
            break
    if len(new_tokens) + len(chunk) >= max_new_tokens and reason is None:
        chunk, reason = chunk[:max_new_tokens - len(new_tokens)], "length"
    new_tokens.extend(chunk)
    return chunk, reason


def generate(target: Runner, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: tuple[int, ...],
             sampling: SamplingParams = SamplingParams(), seed: int | None = None,
             drafter: Drafter | None = None, k: int = 0, emit: Emit | None = None,
             cancel: Cancel | None = None, constraint: Constraint | None = None,
             forced_drafts: bool = False, reuse: bool = False) -> tuple[list[int], str, Stats]:
    """Decode up to max_new_tokens after prompt_ids. Returns (new token ids without EOS,
    finish_reason in eos | stop | length | context_full | <cancel's reason>, stats).
    reuse: keep the cache rows the last request left that match a prefix of prompt_ids.

    constraint (guided decoding, runtime/grammar.py): every logits row the choice is made from is
    masked by the grammar state along the path (the verify rows by the state after the window's
    first i tokens); a draft is cut at its first token the grammar forbids (the q rows of a sampled
    draft are masked and renormalised alike, so speculative sampling still follows the constrained
    target); the loop ends with eos once the grammar admits nothing but EOS. forced_drafts: where
    the grammar forces the next tokens they are the draft (up to k; with or without a drafter):
    the masked target must choose them."""
    speculating = drafter is not None or (constraint is not None and forced_drafts)
    if speculating:
        target.check_width(k + 1)
    stats = Stats(drafter=drafter.name if drafter else "none", k=k if speculating else 0,
                  prompt_tokens=len(prompt_ids), accepted_at=[0] * (k if speculating else 0),
                  verify_calls_by_k=[0] * (k if speculating else 0))
    sampler = Sampler(sampling, seed)
    eos = set(eos_ids)
    started = time.perf_counter()
    reused = common_prefix(target.held, prompt_ids, len(prompt_ids) - 1) if reuse else 0
    target.held = ()  # until this request ends normally: a failure leaves the next one cold
    stats.prompt_tokens_reused = reused
    logits = target.prefill(prompt_ids[reused:], reused)
    if constraint is not None:
        logits = mask_logits(logits[None], constraint.masks([]))[0]
    stats.prefill_time_s = time.perf_counter() - started
    first, _ = sampler.pick(logits)
    seq = list(prompt_ids) + [first]
    pos = len(prompt_ids)
    new_tokens: list[int] = []

    def accept(chunk: list[int]) -> str | None:
        """Append a chunk of chosen tokens to the output; returns a finish reason or None."""
        chunk, reason = take_chunk(new_tokens, chunk, eos, max_new_tokens)
        if constraint is not None:
            constraint.consume(chunk)
            if reason is None and constraint.done:  # only EOS may follow: the masked target's choice
                reason = "eos"
        if chunk and emit is not None and emit(chunk):
            reason = "stop"
        return reason

    finish = accept([first])
    stats.time_to_first_token_s = time.perf_counter() - started
    drafting = drafter is not None and finish is None
    if drafting:
        t0 = time.perf_counter()
        if not reuse and (forget := getattr(drafter, "forget", None)) is not None:
            forget()
        drafter.start(list(prompt_ids))
        stats.draft_time_s += time.perf_counter() - t0
    while finish is None:
        if cancel is not None and (reason := cancel()):
            finish = reason
            break
        if pos >= target.max_context:
            finish = "context_full"
            break
        draft, proposer = None, None
        room = pos + k + 1 <= target.max_context
        if constraint is not None and forced_drafts and room and (forced := constraint.forced()[:k]):
            draft = Draft(tokens=forced, q_draft=None)
            stats.forced += len(forced)
        elif drafter is not None and room:
            t0 = time.perf_counter()
            draft, proposer = drafter.propose(seq, k, sampler), drafter
            stats.draft_time_s += time.perf_counter() - t0
            if draft is not None and constraint is not None:
                draft = cut_draft(draft, constraint, stats, drafter)
        t0 = time.perf_counter()
        if draft is None:
            logits = target.forward([seq[-1]], pos)
            if constraint is not None:
                logits = mask_logits(logits[:1], constraint.masks([]))
            chunk = [sampler.pick(logits[0])[0]]
            stats.step_calls += 1
            pos += 1
        else:
            window = [seq[-1]] + draft.tokens
            if constraint is None and sampling.greedy:
                n_accepted, next_token = greedy_accept(target.argmax(window, pos), draft.tokens)
            elif constraint is None:
                p_target = probabilities(target.forward(window, pos), sampling)
                n_accepted, next_token = speculative_accept(p_target, draft.q_draft, draft.tokens, sampler.rng)
            else:
                n_accepted, next_token = constrained_accept(target, window, pos, draft, constraint, sampler)
            if proposer is not None:
                proposer.observe(len(draft.tokens), n_accepted)
            stats.verified(k, len(draft.tokens), n_accepted)
            chunk = draft.tokens[:n_accepted] + [next_token]
            pos += n_accepted + 1
        stats.target_time_s += time.perf_counter() - t0
        seq.extend(chunk)
        finish = accept(chunk)
    target.held = tuple(seq[:pos])  # seq[pos], the pending token, was never fed
    if drafting and (done := getattr(drafter, "finish", None)) is not None:  # test doubles may lack it
        done()
    stats.new_tokens = len(new_tokens)
    stats.total_time_s = time.perf_counter() - started
    return new_tokens, finish, stats


def cut_draft(draft: Draft, constraint: Constraint, stats: Stats, drafter: Drafter) -> Draft | None:
    """The draft up to its first token the grammar forbids (None when that is the first: a plain
    step follows, and the drafter hears that nothing of it was accepted)."""
    n = constraint.admitted(draft.tokens)
    stats.cut += len(draft.tokens) - n
    if n == 0:
        drafter.observe(len(draft.tokens), 0)
        return None
    if n == len(draft.tokens):
        return draft
    return Draft(tokens=draft.tokens[:n], q_draft=None if draft.q_draft is None else draft.q_draft[:n])


def constrained_accept(target: Runner, window: list[int], pos: int, draft: Draft, constraint: Constraint,
                       sampler: Sampler) -> tuple[int, int]:
    """(n_accepted, next_token) of a verify call under a grammar: row i of the target's logits is
    masked by the grammar state after window[:i + 1]. A window cut shorter than k + 1 runs in the
    smallest verify graph it fits, padded (rows past the window are ignored, like rejected drafts)."""
    width = min(w for w in target.widths if w >= len(window))
    logits = target.forward(window + [window[-1]] * (width - len(window)), pos)[:len(window)]  # (m+1, V)
    allowed = constraint.masks(draft.tokens)  # (m+1, V)
    logits = mask_logits(logits, allowed)
    if sampler.params.greedy:
        return greedy_accept(np.argmax(logits, axis=-1), draft.tokens)
    q = None if draft.q_draft is None else mask_probs(draft.q_draft, allowed[:-1])
    return speculative_accept(probabilities(logits, sampler.params), q, draft.tokens, sampler.rng)
