"""The speculative loop, over slots: up to B requests decode together, one request alone is one
occupied slot (the target's static slots: backends/ort_runner.OrtRunner; B=1 is a runner of one slot).
Per slot: draft k, verify k+1 in one target call, accept, correct.

Invariant, per slot: its cache region holds seq[:pos] and seq[pos] (= seq[-1]) is the pending token,
the last one chosen and not yet fed. A verify feeds [pending, d1..dm] (m <= k) at positions
pos..pos+m, accepts n drafts, appends d1..dn and the target's own next token, and moves pos by n + 1.
Rows written for rejected drafts stay in the cache, masked by position until they are overwritten:
rolling back is only moving pos. Without a draft (no drafter, nothing worth verifying, speculative.k
auto's k = 0, or no room for the verify window) a slot's iteration is a plain step. Target-only decoding is this
same loop with no drafter, so greedy speculative output equals it token for token.

Each slot is one request (SlotRequest: every per-request option in one value) with its own sampler
(its own seed), drafter, k, grammar state, position and stats, so a request's output depends only on
its own logits. One iteration of BatchLoop:

  1. at most one prefill chunk (C tokens, the prefill graph bound to that slot's region) of the
     earliest joined slot still prefilling: a joining prompt is fed between the others' decode calls,
     so running streams never wait for a whole prompt;
  2. the decode call(s) of the decoding slots, over exactly those slots (runner.forward(slots, ...):
     idle and prefilling slots are never in a call and cost nothing): one step call (width 1, or
     q4's two-row step) over the slots without a draft, one verify call over the slots with one (each
     row computed exactly as when its request is alone: measured batch-invariant, docs/bench.md).
Greedy calls ask the runner for argmax ids only (runner.argmax); a call with a slot that samples, processes
its logits (penalties, logit bias, ignore_eos) or reports logprobs takes logits.

Every logits row a slot chooses from (prefill's last row, a step's row, a verify window's rows) is processed
with that row's own history (sampling.processed_logits: the prompt, the tokens emitted before it and, in a
window [pending, d1..dm], d1..di before row i), as target-only decoding processes it at that position; a
drafter's q rows are its own (the acceptance rule keeps the processed target distribution). With
sampling.logprobs = N each emitted token's log-probability and its row's top N (sampling.token_logprobs) go to
its stats.logprobs, one per token of the output.

A slot joins (add) at an iteration boundary and leaves when its request finishes (eos, stop,
length, context_full, cancel's reason: cancel() is asked before each decode call); its slot is free
for the next add.

Drafters: a request brings its drafter (SlotRequest.drafter, e.g. prompt lookup) or has it made for
the slot it takes (SlotRequest.sink.drafter(slot): a drafter over that slot's own regions of the draft
model's / head's caches, runtime/drafting.py). Its life: start(prompt)
once the prompt is in (forget() first without prefix reuse), propose / observe per iteration,
finish() when the request leaves (recording what its cache holds for the slot's next request).

Prefix reuse per slot (reuse=True, serve.reuse_prefix): runner.held[b] is the token ids whose rows
slot b's region holds (base.py). add() puts a request into the free slot whose
record shares the longest prefix with its prompt (ties: the least recently taken, then the lowest
index) and prefills only from min(common prefix, len(prompt) - 1) on; the record is () while the
request runs, seq[:pos] once it leaves (finished or cancelled); an exception inside an iteration
empties every record.

k per slot: the request's k, or under speculative.k: auto (SlotRequest.k_choice, runtime/k_choice.py) the k
(0 included, up to the request's) its KChoice expects fastest at this iteration from its live acceptance and
the loop's call costs (BatchLoop.costs: measured at load, every call's time fed back) at the number of
decoding slots; auto's plain steps count in stats.auto_off_steps. A verify call runs the smallest verify
graph that holds the longest window of its rows (cut, forced or smaller-k drafts are shorter; never q4's
two-row step, which feeds its one token twice): a shorter window is padded with its last token (rows past it
are read by nobody, like rejected drafts). A slot's stats count its verify calls by k. The output is the same
at every k. The load (request.occupancy as it joins) is the occupied slots + `waiting` (what waits in the
caller's queue, which the caller sets).

Guided decoding per slot (SlotRequest.constraint, runtime/grammar.py: one matcher per request): every
logits row a slot chooses from is masked by its grammar state along the path, a draft is cut at its
first forbidden token, grammar-forced tokens are the draft where forced_drafts (up to the iteration's
k), and the slot ends with eos once the grammar admits only EOS. A call with a constrained slot takes
logits.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from spec_edge.runtime.backends.base import BackendError, common_prefix
from spec_edge.runtime.backends.slot_views import Slotted
from spec_edge.runtime.drafters.base import Draft, Drafter
from spec_edge.runtime.grammar import Constraint, mask_logits, mask_probs
from spec_edge.runtime.k_choice import CallCosts, KChoice
from spec_edge.runtime.sampling import (Sampler, SamplingParams, greedy_accept, probabilities,
                                        speculative_accept, token_logprobs)
from spec_edge.runtime.stats import Stats


class SlotSink(Protocol):
    """Where a slot's request goes, one object per request (the engine's turns tokens into text for its serving.Sink):
    drafter(slot) its drafter over that slot's caches (None: it brings its own, or none), asked as it takes the slot;
    emit(chunk) the tokens just chosen (True: stop, a stop string showed up); cancel_reason() before each decode
    call (None: go on; else the finish reason); done(request, token_ids, finish_reason, stats) once, from the
    loop's thread, as it leaves."""

    def drafter(self, slot: int) -> Drafter | None: ...

    def emit(self, chunk: list[int]) -> bool: ...

    def cancel_reason(self) -> str | None: ...

    def done(self, request: SlotRequest, token_ids: list[int], finish: str, stats: Stats) -> None: ...


def take_chunk(new_tokens: list[int], chunk: list[int], eos, max_new_tokens: int) -> tuple[list[int], str | None]:
    """Append chosen tokens to new_tokens up to the first EOS (not kept) or max_new_tokens; returns
    (the part appended, "eos" | "length" | None)."""
    reason = None
    for i, token in enumerate(chunk):
        if token in eos:
            chunk, reason = chunk[:i], "eos"
            break
    if len(new_tokens) + len(chunk) >= max_new_tokens and reason is None:
        chunk, reason = chunk[:max_new_tokens - len(new_tokens)], "length"
    new_tokens.extend(chunk)
    return chunk, reason


@dataclass
class SlotRequest:
    """One request and every option it runs with."""
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    k: int = 0  # drafts per verify call it asks for (0, or without a drafter / forced drafts: plain steps)
    drafter: Drafter | None = None  # this request's own (a drafter keeps per-request state), else its sink's
    sink: SlotSink | None = None    # its output (None: nothing streamed, never cancelled, the result dropped)
    constraint: Constraint | None = None  # guided decoding: this request's grammar state
    forced_drafts: bool = False           # with a constraint: the tokens the grammar forces are the draft
    occupancy: int = 0  # set by BatchLoop.add: the load as it joined, itself included (1 = alone)
    k_choice: KChoice | None = None  # speculative.k auto: chooses each iteration's k <= k (None: always k)
    # a vision model's prompt with images (vision/encoder.py): (P, hidden) float32 the image rows of the prompt's
    # image tokens and (P,) bool which positions they are; prefix reuse stops at the first of them
    image_rows: np.ndarray | None = None
    image_mask: np.ndarray | None = None

    @property
    def speculating(self) -> bool:
        """It drafts (a drafter, or grammar-forced drafts) at some k > 0."""
        return self.k > 0 and (self.drafter is not None or (self.constraint is not None and self.forced_drafts))

    @property
    def argmax_only(self) -> bool:
        """Its calls may ask the runner for argmax ids: greedy, logits unprocessed, no grammar, no logprobs."""
        return (self.sampling.greedy and not self.sampling.processes and self.constraint is None
                and not self.sampling.logprobs)


@dataclass
class _Slot:
    request: SlotRequest
    sampler: Sampler
    stats: Stats
    started: float
    prefilled: int = 0                  # prompt tokens in the cache so far
    seq: list[int] = field(default_factory=list)
    pos: int = 0                        # the cache holds seq[:pos]; seq[pos] is pending
    new_tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    draft: Draft | None = None          # this iteration's proposal
    k_now: int = 0                      # this iteration's k (<= stats.k; the k_choice's under auto)
    proposed: bool = False              # the draft is the drafter's (not grammar-forced): it hears the outcome
    drafting: bool = False              # the drafter was started (finish() it as the slot leaves)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids) and self.finish is None

    @property
    def generated(self) -> list[int]:
        """The tokens chosen after the prompt (the pending one included)."""
        return self.seq[len(self.request.prompt_ids):]


class BatchLoop:
    """B slots over one slotted runner: the engine's (engine.Engine.add / iterate), which the scheduler drives
    (runtime/scheduler.py: the one driver of every decoder)."""

    def __init__(self, runner: Slotted, *, reuse: bool = False, costs: CallCosts | None = None):
        self.step_width = runner.step_width  # 2: q4's two-row step (ort_runner.py)
        runner.check_width(self.step_width)
        # the widths that verify: every row its own token (q4's two-row step feeds its one token twice)
        self.verify_widths = frozenset(w for w in runner.widths if w > 1 and w != self.step_width)
        self.runner = runner
        self.costs = costs or CallCosts()  # ms per call by (rows, width): k_choice's costs, every call fed back
        self.reuse = reuse  # prefix reuse per slot (runner.held)
        self.waiting = 0  # requests waiting in the caller's queue (the caller keeps it): part of the load
        self._taken = [0] * runner.batch  # (B,) the order slots were last taken in (higher = later; 0 = never)
        self.slots: list[_Slot | None] = [None] * runner.batch
        self.iterations = 0
        self.calls = {"prefill": 0, "step": 0, "verify": 0}

    @property
    def occupied(self) -> int:
        return sum(slot is not None for slot in self.slots)

    @property
    def free(self) -> int:
        return self.runner.batch - self.occupied

    @property
    def load(self) -> int:
        """The requests in the engine: occupied slots + those waiting in the caller's queue."""
        return self.occupied + self.waiting

    def add(self, request: SlotRequest) -> int:
        """Put request into a free slot (it starts prefilling at the next iteration); returns the slot. Its prompt
        is 1 .. max_context - 1 tokens (runtime/front.py checked it)."""
        free = [i for i, slot in enumerate(self.slots) if slot is None]
        if not free:
            raise BackendError(f"all {self.runner.batch} batch slots are busy")
        prompt = request.prompt_ids
        held = self.runner.held
        # the free slot holding the longest prefix of the prompt (ties: the one taken least recently, so
        # the records other clients may come back to are kept longest; then the lowest index); at least
        # the last prompt token is prefilled (its logits choose the first token)
        limit = len(prompt) - 1
        if request.image_mask is not None and request.image_mask.any():  # the same ids, maybe other pixels
            limit = min(limit, int(np.argmax(request.image_mask)))
        shared = {i: common_prefix(held[i], prompt, limit) if self.reuse else 0 for i in free}
        index = max(free, key=lambda i: (shared[i], -self._taken[i], -i))
        if request.drafter is None and request.sink is not None:
            request.drafter = request.sink.drafter(index)  # before the slot is taken: it may refuse
        k = request.k if request.speculating else 0
        if k:
            self.runner.check_width(k + 1)
        self._taken[index] = max(self._taken) + 1
        held[index] = ()  # until the request leaves: a failure leaves the slot cold
        drafter = request.drafter
        stats = Stats(drafter=drafter.name if drafter else "none", k=k, prompt_tokens=len(prompt),
                      prompt_tokens_reused=shared[index], accepted_at=[0] * k, verify_calls_by_k=[0] * k)
        self.slots[index] = _Slot(request, Sampler(request.sampling, request.seed, prompt), stats, time.perf_counter(),
                                  prefilled=shared[index])
        request.occupancy = self.load
        return index

    def iterate(self) -> None:
        """One iteration: a prefill chunk of one joining slot, then the decode call(s) of the decoding slots.
        An exception (a failed call, an emit that raised) empties every slot's prefix record."""
        self.iterations += 1
        try:
            joining = [slot for slot in self.slots if slot is not None and slot.finish is None and not slot.decoding]
            if joining:
                self._prefill_chunk(min(joining, key=lambda slot: slot.started))
            self._decode()
            for i, slot in enumerate(self.slots):
                if slot is not None and slot.finish is not None:
                    self._leave(i)
        except BaseException:
            self.runner.held = [()] * self.runner.batch  # whatever the regions hold now, nothing is trusted
            raise

    def clear(self) -> None:
        """Empty every slot without answering (after a failed call: the caller answers its requests)."""
        self.slots = [None] * self.runner.batch
        self.runner.held = [()] * self.runner.batch

    # -- one slot's prefill ----------------------------------------------------------------------

    def _prefill_chunk(self, slot: _Slot) -> None:
        index = next(i for i, other in enumerate(self.slots) if other is slot)
        prompt, chunk = slot.request.prompt_ids, self.runner.prefill_chunk
        t0 = time.perf_counter()
        start, stop = slot.prefilled, slot.prefilled + chunk
        mask = slot.request.image_mask
        if mask is not None and mask[start:stop].any():  # image rows in this chunk
            logits = self.runner.prefill_chunk_at(index, prompt[start:stop], start, slot.request.image_rows[start:stop],
                                                  mask[start:stop])
        else:
            logits = self.runner.prefill_chunk_at(index, prompt[start:stop], start)
        self.calls["prefill"] += 1
        slot.prefilled = min(len(prompt), slot.prefilled + chunk)
        slot.stats.prefill_time_s += time.perf_counter() - t0
        if slot.prefilled < len(prompt):
            return
        rows = logits[None]  # (1, V)
        if slot.request.constraint is not None:
            rows = mask_logits(rows, slot.request.constraint.masks([]))
        rows = slot.sampler.process(rows, [])
        first, _ = slot.sampler.pick(rows[0])
        slot.seq = list(prompt) + [first]
        slot.pos = len(prompt)
        slot.finish = self._accept(slot, [first], rows)
        slot.stats.time_to_first_token_s = time.perf_counter() - slot.started
        drafter = slot.request.drafter
        if drafter is not None and slot.finish is None:
            t0 = time.perf_counter()
            if not self.reuse:
                drafter.forget()  # its cache's record is ignored: cold
            drafter.start(list(prompt))
            slot.drafting = True
            slot.stats.draft_time_s += time.perf_counter() - t0

    # -- the decode call -------------------------------------------------------------------------

    def _decode(self) -> None:
        runner = self.runner
        decoding = [i for i, slot in enumerate(self.slots) if slot is not None and slot.decoding]
        for i in list(decoding):
            slot = self.slots[i]
            if slot.request.sink is not None and (reason := slot.request.sink.cancel_reason()):  # before each call
                slot.finish = reason
                decoding.remove(i)
            elif slot.pos >= runner.max_context:
                slot.finish = "context_full"
                decoding.remove(i)
        if not decoding:
            return
        for i in decoding:
            slot = self.slots[i]
            slot.k_now = slot.stats.k
            if slot.request.k_choice is not None and slot.k_now:
                slot.k_now = slot.request.k_choice.choose(slot.stats.k, self.costs, len(decoding), self.step_width)
            self._propose(slot)
        verifying = [i for i in decoding if self.slots[i].draft is not None]
        stepping = [i for i in decoding if self.slots[i].draft is None]
        # the smallest verify graph holding the longest window (cut or forced drafts can be shorter than k)
        if stepping:
            self._call(stepping, self.step_width)
        if verifying:
            width = self._width(verifying)
            # a slot near the end of its cache whose window a wider slot's would push past it: a call of its own
            cramped = [i for i in verifying if self.slots[i].pos + width > runner.max_context]
            if len(cramped) < len(verifying):
                self._call([i for i in verifying if i not in cramped], width)
            for i in cramped:
                self._call([i], self._width([i]))

    def _width(self, rows: list[int]) -> int:
        """The smallest verify graph holding the longest window [pending, drafts] of the slots rows."""
        longest = max(len(self.slots[i].draft.tokens) + 1 for i in rows)
        return min(w for w in self.verify_widths if w >= longest)

    def _propose(self, slot: _Slot) -> None:
        """slot.draft for this iteration (None: a plain step): grammar-forced tokens, else the drafter's
        proposal cut at its first token the grammar forbids; at most slot.k_now tokens."""
        request, stats, k = slot.request, slot.stats, slot.k_now
        constraint, drafter = request.constraint, request.drafter
        slot.draft, slot.proposed = None, False
        if (not k and stats.k and request.k_choice is not None and constraint is not None
                and request.forced_drafts and constraint.forced()):
            # auto's plain step never drops grammar-forced tokens: no drafter runs and, the grammar allowing
            # nothing else, the target accepts them all
            k = slot.k_now = stats.k
        room = slot.pos + k + 1 <= self.runner.max_context
        if stats.k and not k:
            stats.auto_off_steps += 1
        elif constraint is not None and request.forced_drafts and room and (forced := constraint.forced()[:k]):
            slot.draft = Draft(tokens=forced, q_draft=None)
            stats.forced += len(forced)
        elif drafter is not None and room:
            t0 = time.perf_counter()
            slot.draft, slot.proposed = drafter.propose(slot.seq, k, slot.sampler), True
            stats.draft_time_s += time.perf_counter() - t0
            if request.k_choice is not None:
                request.k_choice.drafted(k, (time.perf_counter() - t0) * 1000)
                if slot.draft is None:
                    request.k_choice.silent()
            if slot.draft is not None and constraint is not None:
                slot.draft = cut_draft(slot.draft, constraint, stats, drafter)

    def _call(self, rows: list[int], width: int) -> None:
        """One call over exactly the slots rows (ascending): each slot's pending token and its draft,
        padded to width with its last token (a slot without a draft: width is the step's, row 0 read)."""
        runner, slots = self.runner, [self.slots[i] for i in rows]
        windows = [[slot.seq[-1]] + (slot.draft.tokens if slot.draft is not None else []) for slot in slots]
        tokens = np.array([window + [window[-1]] * (width - len(window)) for window in windows], np.int64)  # (n, T)
        positions = [slot.pos for slot in slots]
        greedy = all(slot.request.argmax_only for slot in slots)
        t0 = time.perf_counter()
        out = (runner.argmax if greedy else runner.forward)(rows, tokens, positions)  # (n, T) ids or (n, T, V)
        self.calls["verify" if any(slot.draft is not None for slot in slots) else "step"] += 1
        spent = time.perf_counter() - t0
        self.costs.observe(len(rows), width, spent * 1000)
        for j, (slot, window) in enumerate(zip(slots, windows)):
            slot.stats.target_time_s += spent
            draft, constraint = slot.draft, slot.request.constraint
            rows = None  # (len(chunk).., V) the processed rows the chunk's tokens were chosen from
            if draft is None:
                if greedy:
                    chunk = [int(out[j, 0])]
                else:
                    logits = out[j, :1] if constraint is None else mask_logits(out[j, :1], constraint.masks([]))
                    rows = slot.sampler.process(logits, slot.generated)
                    chunk = [slot.sampler.pick(rows[0])[0]]
                slot.stats.step_calls += 1
                slot.pos += 1
            else:
                if greedy:
                    n_accepted, next_token = greedy_accept(out[j, :len(window)], draft.tokens)
                else:
                    n_accepted, next_token, rows = accept_rows(out[j, :len(window)], draft, constraint,
                                                               slot.sampler, slot.generated)
                if slot.proposed:
                    slot.request.drafter.observe(len(draft.tokens), n_accepted)
                slot.stats.verified(slot.k_now, len(draft.tokens), n_accepted)
                if slot.request.k_choice is not None:
                    slot.request.k_choice.observe(len(draft.tokens), n_accepted, slot.k_now)
                chunk = draft.tokens[:n_accepted] + [next_token]
                slot.pos += n_accepted + 1
            slot.seq.extend(chunk)
            slot.finish = self._accept(slot, chunk, rows)

    # -- a slot's output -------------------------------------------------------------------------

    @staticmethod
    def _accept(slot: _Slot, chunk: list[int], rows: np.ndarray | None = None) -> str | None:
        """Append a chunk of chosen tokens to the slot's output (and, with sampling.logprobs, their
        log-probabilities from rows: (>= len(chunk), V) the processed rows they were chosen from); a
        finish reason or None."""
        request = slot.request
        chunk, reason = take_chunk(slot.new_tokens, chunk, request.eos_ids, request.max_new_tokens)
        if request.sampling.logprobs and chunk:
            slot.stats.logprobs += token_logprobs(rows[:len(chunk)], chunk, request.sampling.logprobs)
        if request.constraint is not None:
            request.constraint.consume(chunk)
            if reason is None and request.constraint.done:  # only EOS may follow: the masked target's choice
                reason = "eos"
        if chunk and request.sink is not None and request.sink.emit(chunk):
            reason = "stop"
        return reason

    def _leave(self, index: int) -> None:
        slot = self.slots[index]
        self.slots[index] = None
        self.runner.held[index] = tuple(slot.seq[:slot.pos])  # seq[pos], the pending token, was never fed
        if slot.drafting:
            slot.request.drafter.finish()  # the drafter's cache record
        slot.stats.new_tokens = len(slot.new_tokens)
        slot.stats.total_time_s = time.perf_counter() - slot.started
        if slot.request.sink is not None:
            slot.request.sink.done(slot.request, slot.new_tokens, slot.finish, slot.stats)


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


def accept_rows(logits: np.ndarray, draft: Draft, constraint: Constraint | None, sampler: Sampler,
                generated: Sequence[int]) -> tuple[int, int, np.ndarray]:
    """(n_accepted, next_token, the processed rows (m+1, V)) of one slot's verify rows, logits (m+1, V) for
    the window [pending, d1..dm] (m <= k), generated: the tokens chosen before d1 (pending included). Row i
    is processed with the history prompt + generated + d1..di (Sampler.process) and, under a grammar,
    masked by the state after the window's first i tokens (the q rows of a sampled draft masked and
    renormalised alike); then greedy or speculative sampling."""
    q = draft.q_draft
    if constraint is not None:
        allowed = constraint.masks(draft.tokens)  # (m+1, V)
        logits = mask_logits(logits, allowed)
        if not sampler.params.greedy and q is not None:
            q = mask_probs(q, allowed[:-1])
    logits = sampler.process(logits, generated, draft.tokens)
    if sampler.params.greedy:
        return (*greedy_accept(np.argmax(logits, axis=-1), draft.tokens), logits)
    return (*speculative_accept(probabilities(logits, sampler.params), q, draft.tokens, sampler.rng), logits)
