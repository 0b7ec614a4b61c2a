"""In-flight batching: up to B requests decode together in the batched graphs' static slots.

Each slot is one request with its own sampler (its own seed), drafter, position and stats; the
per-slot logic is speculative.generate's, step for step, so a request's output depends only on its
own logits. One iteration of BatchLoop:

  1. at most one prefill chunk (C tokens, the B=1 prefill graph bound to that slot's region) of the
     earliest joined slot still prefilling: a joining prompt is fed between the others' decode calls,
     so running streams never wait for a whole prompt;
  2. the decode call(s) of the decoding slots, over exactly those slots (runner.forward(slots, ...):
     idle and prefilling slots are never in a call and cost nothing): one step call (width 1, or
     q4's two-row step) when no slot has a draft, one (k+1) verify call when all have one. When some
     do and some do not, mixed="group" (the default) runs the stepping slots and the verifying slots
     as two calls over those two subsets (each row computed exactly as when its request is alone:
     measured batch-invariant, bench/batch_invariance.py); mixed="pad" runs them along in the
     (k+1) call as [pending, pending, ...], reading only row 0 (one call, but that row is a
     width-(k+1) row: 3.6e-5 from the step's logits on the embedded default, fp32).
Greedy calls ask the runner for argmax ids only (runner.argmax); a call with a sampling slot takes logits.

A slot joins (add) at an iteration boundary and leaves when its request finishes (eos, stop,
length, context_full, cancelled); its slot is free for the next add.

Drafters: a request brings its drafter (SlotRequest.drafter, e.g. prompt lookup) or has it made for
the slot it takes (SlotRequest.make_drafter(slot): a drafter over that slot's own regions of the draft
model's / head's caches, runtime/slot_drafting.py). Its life is speculative.generate's: start(prompt)
once the prompt is in (forget() first without prefix reuse), propose / observe per iteration,
finish() when the request leaves (recording what its cache holds for the slot's next request).

Prefix reuse per slot (reuse=True, serve.reuse_prefix): runner.held[b] is the token ids whose rows
slot b's region holds (as Runner.held for B=1). add() puts a request into the free slot whose
record shares the longest prefix with its prompt (ties: the least recently taken, then the lowest
index) and prefills only from min(common prefix, len(prompt) - 1) on; the record is () while the
request runs, seq[:pos] once it leaves (finished or cancelled); an exception inside an iteration
empties every record.

k_by_load (serve.speculate_k_by_load, spec_edge/speculation_policy.py; () = always k): the k of an
iteration is k_now(), the table's entry at the occupied slots (capped at k), 0 = no drafts: each
draft is cut to that k and verified in the (B, k'+1) graph; a slot's stats count its verify calls by
k and the steps the policy took (greedy output is the same; `spec-edge tune` measures the table).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from spec_edge import speculation_policy
from spec_edge.runtime.backends.base import BackendError, common_prefix
from spec_edge.runtime.sampling import SamplingParams, greedy_accept, probabilities, speculative_accept
from spec_edge.runtime.speculative import Cancel, Draft, Drafter, Emit, Sampler, Stats, take_chunk

MIXED = ("pad", "group")  # how an iteration runs slots that step beside slots that verify


@dataclass
class SlotRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    drafter: Drafter | None = None  # this request's own (a drafter keeps per-request state)
    # or: made by BatchLoop.add for the slot the request takes (a drafter over that slot's caches)
    make_drafter: Callable[[int], Drafter] | None = None
    emit: Emit | None = None
    cancel: Cancel | None = None
    # on_done(token_ids, finish_reason, stats): called once, from the loop's thread, when it leaves
    on_done: Callable[[list[int], str, Stats], None] | None = None
    occupancy: int = 0  # set by BatchLoop.add: occupied slots as it joined, itself included (1 = alone)


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
    drafting: bool = False              # the drafter was started (finish() it as the slot leaves)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids) and self.finish is None


class BatchLoop:
    """B slots over one BatchRunner; the caller adds requests and calls iterate() until idle."""

    def __init__(self, runner, k: int = 0, *, mixed: str = "group", k_by_load: Sequence[int] = (),
                 reuse: bool = False):
        if mixed not in MIXED:
            raise ValueError(f"mixed must be one of {MIXED}, got {mixed!r}")
        for used in sorted({k, *(min(k, entry) for entry in k_by_load)} - {0}):
            runner.check_width(used + 1)  # every k the load policy can choose has its verify graph
        self.step_width = getattr(runner, "step_width", 1)  # 2: q4's two-row step (ort_batch.py)
        runner.check_width(self.step_width)
        self.runner, self.k, self.mixed = runner, k, mixed
        self.k_by_load = tuple(k_by_load)
        self.reuse = reuse  # prefix reuse per slot (runner.held)
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

    def k_now(self) -> int:
        """The drafts per verify call at this iteration: the load policy's entry at the occupancy."""
        return speculation_policy.k_at(self.k_by_load, self.occupied, self.k)

    def add(self, request: SlotRequest) -> int:
        """Put request into a free slot (it starts prefilling at the next iteration); returns the slot."""
        if not request.prompt_ids:
            raise BackendError("a request needs at least one prompt token")
        if len(request.prompt_ids) >= self.runner.max_context:
            raise BackendError(f"the prompt ({len(request.prompt_ids)} tokens) leaves no room in the "
                               f"{self.runner.max_context}-token cache")
        free = [i for i, slot in enumerate(self.slots) if slot is None]
        if not free:
            raise BackendError(f"all {self.runner.batch} batch slots are busy")
        prompt = request.prompt_ids
        held = self.runner.held
        # the free slot holding the longest prefix of the prompt (ties: the one taken least recently, so
        # the records other clients may come back to are kept longest; then the lowest index); at least
        # the last prompt token is prefilled (its logits choose the first token)
        shared = {i: common_prefix(held[i], prompt, len(prompt) - 1) if self.reuse else 0 for i in free}
        index = max(free, key=lambda i: (shared[i], -self._taken[i], -i))
        if request.drafter is None and request.make_drafter is not None:
            request.drafter = request.make_drafter(index)  # before the slot is taken: it may refuse
        self._taken[index] = max(self._taken) + 1
        held[index] = ()  # until the request leaves: a failure leaves the slot cold
        drafter = request.drafter
        stats = Stats(drafter=drafter.name if drafter else "none", k=self.k if drafter else 0,
                      prompt_tokens=len(prompt), prompt_tokens_reused=shared[index],
                      accepted_at=[0] * (self.k if drafter else 0), verify_calls_by_k=[0] * (self.k if drafter else 0))
        self.slots[index] = _Slot(request, Sampler(request.sampling, request.seed), stats, time.perf_counter(),
                                  prefilled=shared[index])
        request.occupancy = self.occupied
        return index

    def iterate(self) -> None:
        """One iteration: a prefill chunk of one joining slot, then the decode call(s) of the decoding slots.
        An exception (a failed call, an emit that raised) empties every slot's prefix record."""
        self.iterations += 1
        try:
            for slot in self.slots:  # cancellation is seen at the iteration boundary, as in speculative.generate
                if slot is not None and slot.decoding and slot.request.cancel is not None \
                        and (reason := slot.request.cancel()):
                    slot.finish = reason
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

    def run(self) -> None:
        """iterate() until every slot has left."""
        while self.occupied:
            self.iterate()

    # -- one slot's prefill ----------------------------------------------------------------------

    def _prefill_chunk(self, slot: _Slot) -> None:
        index = next(i for i, other in enumerate(self.slots) if other is slot)
        prompt, chunk = slot.request.prompt_ids, self.runner.prefill_chunk
        t0 = time.perf_counter()
        logits = self.runner.prefill_chunk_at(index, prompt[slot.prefilled:slot.prefilled + chunk], slot.prefilled)
        self.calls["prefill"] += 1
        slot.prefilled = min(len(prompt), slot.prefilled + chunk)
        slot.stats.prefill_time_s += time.perf_counter() - t0
        if slot.prefilled < len(prompt):
            return
        first, _ = slot.sampler.pick(logits)
        slot.seq = list(prompt) + [first]
        slot.pos = len(prompt)
        slot.finish = self._accept(slot, [first])
        slot.stats.time_to_first_token_s = time.perf_counter() - slot.started
        drafter = slot.request.drafter
        if drafter is not None and slot.finish is None:
            t0 = time.perf_counter()
            if not self.reuse and (forget := getattr(drafter, "forget", None)) is not None:
                forget()  # its cache's record is ignored: cold, as speculative.generate with reuse=False
            drafter.start(list(prompt))
            slot.drafting = True
            slot.stats.draft_time_s += time.perf_counter() - t0

    # -- the decode call -------------------------------------------------------------------------

    def _decode(self) -> None:
        runner, k = self.runner, self.k_now()
        decoding = [i for i, slot in enumerate(self.slots) if slot is not None and slot.decoding]
        for i in list(decoding):
            slot = self.slots[i]
            if slot.pos >= runner.max_context:
                slot.finish = "context_full"
                decoding.remove(i)
        if not decoding:
            return
        for i in decoding:
            slot = self.slots[i]
            slot.draft = None
            if slot.request.drafter is not None and not k:
                slot.stats.policy_off_steps += 1
            elif slot.request.drafter is not None and slot.pos + k + 1 <= runner.max_context:
                t0 = time.perf_counter()
                slot.draft = slot.request.drafter.propose(slot.seq, k, slot.sampler)
                slot.stats.draft_time_s += time.perf_counter() - t0
        verifying = [i for i in decoding if self.slots[i].draft is not None]
        stepping = [i for i in decoding if self.slots[i].draft is None]
        cramped = any(self.slots[i].pos + k + 1 > runner.max_context for i in stepping)  # no room for padding
        if verifying and stepping and (self.mixed == "group" or cramped):
            self._call(stepping, self.step_width)
            self._call(verifying, k + 1)
        elif verifying:
            self._call(decoding, k + 1)
        else:
            self._call(decoding, self.step_width)

    def _call(self, rows: list[int], width: int) -> None:
        """One call over exactly the slots rows (ascending): each slot's pending token and its draft
        (a slot without one: its pending token repeated, row 0 read)."""
        runner, slots = self.runner, [self.slots[i] for i in rows]
        tokens = np.array([[slot.seq[-1]] + (slot.draft.tokens if slot.draft is not None else
                                             [slot.seq[-1]] * (width - 1)) for slot in slots], np.int64)  # (n, T)
        positions = [slot.pos for slot in slots]
        greedy = all(slot.request.sampling.greedy for slot in slots)
        t0 = time.perf_counter()
        out = (runner.argmax if greedy else runner.forward)(rows, tokens, positions)  # (n, T) ids or (n, T, V)
        self.calls["verify" if any(slot.draft is not None for slot in slots) else "step"] += 1
        spent = time.perf_counter() - t0
        for j, slot in enumerate(slots):
            slot.stats.target_time_s += spent
            draft, sampling = slot.draft, slot.request.sampling
            if draft is None:
                chunk = [int(out[j, 0]) if greedy else slot.sampler.pick(out[j, 0])[0]]
                slot.stats.step_calls += 1
                slot.pos += 1
            else:
                if sampling.greedy:
                    n_accepted, next_token = greedy_accept(out[j] if greedy else np.argmax(out[j], axis=-1),
                                                           draft.tokens)
                else:
                    p_target = probabilities(out[j], sampling)
                    n_accepted, next_token = speculative_accept(p_target, draft.q_draft, draft.tokens, slot.sampler.rng)
                slot.request.drafter.observe(len(draft.tokens), n_accepted)
                slot.stats.verified(width - 1, len(draft.tokens), n_accepted)
                chunk = draft.tokens[:n_accepted] + [next_token]
                slot.pos += n_accepted + 1
            slot.seq.extend(chunk)
            slot.finish = self._accept(slot, chunk)

    # -- a slot's output -------------------------------------------------------------------------

    @staticmethod
    def _accept(slot: _Slot, chunk: list[int]) -> str | None:
        """speculative.generate's accept() for a slot: append chosen tokens; a finish reason or None."""
        request = slot.request
        chunk, reason = take_chunk(slot.new_tokens, chunk, request.eos_ids, request.max_new_tokens)
        if chunk and request.emit is not None and request.emit(chunk):
            reason = "stop"
        return reason

    def _leave(self, index: int) -> None:
        slot = self.slots[index]
        self.slots[index] = None
        self.runner.held[index] = tuple(slot.seq[:slot.pos])  # seq[pos], the pending token, was never fed
        if slot.drafting and (done := getattr(slot.request.drafter, "finish", None)) is not None:
            done()  # the drafter's cache record (test doubles may lack it)
        slot.stats.new_tokens = len(slot.new_tokens)
        slot.stats.total_time_s = time.perf_counter() - slot.started
        if slot.request.on_done is not None:
            slot.request.on_done(slot.new_tokens, slot.finish, slot.stats)


def generate_all(runner, requests: list[SlotRequest], k: int = 0, *, join_at: list[int] | None = None,
                 mixed: str = "group", k_by_load: Sequence[int] = (),
                 reuse: bool = False) -> list[tuple[list[int], str, Stats]]:
    """Run requests through one BatchLoop, request i joining at iteration join_at[i] (default 0) or
    as soon as a slot is free after it; returns (token ids, finish reason, stats) per request."""
    join_at = join_at or [0] * len(requests)
    results: list = [None] * len(requests)
    loop = BatchLoop(runner, k, mixed=mixed, k_by_load=k_by_load, reuse=reuse)
    waiting = sorted(range(len(requests)), key=lambda i: join_at[i])
    for i in waiting:
        previous = requests[i].on_done

        def done(ids, finish, stats, i=i, previous=previous):
            results[i] = (ids, finish, stats)
            if previous is not None:
                previous(ids, finish, stats)
        requests[i].on_done = done
    while waiting or loop.occupied:
        while waiting and join_at[waiting[0]] <= loop.iterations and loop.free:
            loop.add(requests[waiting.pop(0)])
        loop.iterate()
    return results
