"""In-flight batching: up to B requests decode together in the batched graphs' static slots.

Each slot is one request with its own sampler (its own seed), drafter, position and stats; the
per-slot logic is speculative.generate's, step for step, so a request's output depends only on its
own logits. One iteration of BatchLoop:

  1. at most one prefill chunk (C tokens, the B=1 prefill graph bound to that slot's region) of the
     earliest joined slot still prefilling: a joining prompt is fed between the others' decode calls,
     so running streams never wait for a whole prompt;
  2. the decode call(s) of the decoding slots: (B, 1) when no slot has a draft, (B, k+1) when all
     have one. When some do and some do not, mixed="group" (the default) gives the slots that only
     step their own (B, 1) call (two calls, each row computed exactly as when its request is alone:
     measured batch-invariant, bench/batch_invariance.py); mixed="pad" runs them along in the
     (B, k+1) call as [pending, pending, ...], reading only row 0 (one call, but that row is a
     width-(k+1) row: 3.6e-5 from the step's logits on the embedded default, fp32).

A slot joins (add) at an iteration boundary and leaves when its request finishes (eos, stop,
length, context_full, cancelled); its slot is free for the next add. Slots that are idle or still
prefilling are inactive rows: ort_batch.BatchRunner feeds them at their own position, where nothing
is read before it is written again.

speculate_max_active (0 = always): with more occupied slots than this an iteration does not draft
(greedy output is the same; `spec-edge tune` measures where speculation stops paying).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from spec_edge.runtime.backends.base import BackendError
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

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids) and self.finish is None


class BatchLoop:
    """B slots over one BatchRunner; the caller adds requests and calls iterate() until idle."""

    def __init__(self, runner, k: int = 0, *, mixed: str = "group", speculate_max_active: int = 0):
        if mixed not in MIXED:
            raise ValueError(f"mixed must be one of {MIXED}, got {mixed!r}")
        if k:
            runner.check_width(k + 1)
        self.step_width = getattr(runner, "step_width", 1)  # 2: q4's two-row step (ort_batch.py)
        runner.check_width(self.step_width)
        self.runner, self.k, self.mixed = runner, k, mixed
        self.speculate_max_active = speculate_max_active
        self.slots: list[_Slot | None] = [None] * runner.batch
        self.iterations = 0
        self.calls = {"prefill": 0, "step": 0, "verify": 0}

    @property
    def occupied(self) -> int:
        return sum(slot is not None for slot in self.slots)

    @property
    def free(self) -> int:
        return self.runner.batch - self.occupied

    def add(self, request: SlotRequest) -> int:
        """Put request into a free slot (it starts prefilling at the next iteration); returns the slot."""
        if not request.prompt_ids:
            raise BackendError("a request needs at least one prompt token")
        if len(request.prompt_ids) >= self.runner.max_context:
            raise BackendError(f"the prompt ({len(request.prompt_ids)} tokens) leaves no room in the "
                               f"{self.runner.max_context}-token cache")
        index = next((i for i, slot in enumerate(self.slots) if slot is None), None)
        if index is None:
            raise BackendError(f"all {self.runner.batch} batch slots are busy")
        drafter = request.drafter
        stats = Stats(drafter=drafter.name if drafter else "none", k=self.k if drafter else 0,
                      prompt_tokens=len(request.prompt_ids), accepted_at=[0] * (self.k if drafter else 0))
        self.slots[index] = _Slot(request, Sampler(request.sampling, request.seed), stats, time.perf_counter())
        request.occupancy = self.occupied
        return index

    def iterate(self) -> None:
        """One iteration: a prefill chunk of one joining slot, then one decode call for all decoding slots."""
        self.iterations += 1
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

    def clear(self) -> None:
        """Empty every slot without answering (after a failed call: the caller answers its requests)."""
        self.slots = [None] * self.runner.batch

    def run(self) -> None:
        """iterate() until every slot has left."""
        while self.occupied:
            self.iterate()

    # -- one slot's prefill ----------------------------------------------------------------------

    def _prefill_chunk(self, slot: _Slot) -> None:
        index = self.slots.index(slot)
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
        if slot.request.drafter is not None and slot.finish is None:
            t0 = time.perf_counter()
            slot.request.drafter.start(list(prompt))
            slot.stats.draft_time_s += time.perf_counter() - t0

    # -- the decode call -------------------------------------------------------------------------

    def _decode(self) -> None:
        runner, k = self.runner, self.k
        decoding = [i for i, slot in enumerate(self.slots) if slot is not None and slot.decoding]
        for i in list(decoding):
            slot = self.slots[i]
            if slot.pos >= runner.max_context:
                slot.finish = "context_full"
                decoding.remove(i)
        if not decoding:
            return
        speculate = k > 0 and (self.speculate_max_active == 0 or self.occupied <= self.speculate_max_active)
        for i in decoding:
            slot = self.slots[i]
            slot.draft = None
            if speculate and slot.request.drafter is not None and slot.pos + k + 1 <= runner.max_context:
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
        runner = self.runner
        tokens = np.zeros((runner.batch, width), np.int64)
        positions = [0] * runner.batch
        active = [False] * runner.batch
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            positions[i] = slot.pos if slot.decoding else slot.prefilled  # idle rows write where nothing is read
            if i in rows:
                active[i] = True
                tokens[i] = [slot.seq[-1]] + (slot.draft.tokens if slot.draft is not None else
                                              [slot.seq[-1]] * (width - 1))
        t0 = time.perf_counter()
        logits = runner.forward(tokens, positions, active)
        self.calls["verify" if any(self.slots[i].draft is not None for i in rows) else "step"] += 1
        spent = time.perf_counter() - t0
        for i in rows:
            slot = self.slots[i]
            slot.stats.target_time_s += spent
            draft, sampling = slot.draft, slot.request.sampling
            if draft is None:
                chunk = [slot.sampler.pick(logits[i, 0])[0]]
                slot.stats.step_calls += 1
                slot.pos += 1
            else:
                window = width
                if sampling.greedy:
                    n_accepted, next_token = greedy_accept(np.argmax(logits[i, :window], axis=-1), draft.tokens)
                else:
                    p_target = probabilities(logits[i, :window], sampling)
                    n_accepted, next_token = speculative_accept(p_target, draft.q_draft, draft.tokens, slot.sampler.rng)
                slot.request.drafter.observe(self.k, n_accepted)
                stats = slot.stats
                stats.verify_calls += 1
                stats.drafted += self.k
                stats.accepted += n_accepted
                for j in range(n_accepted):
                    stats.accepted_at[j] += 1
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
        slot.stats.new_tokens = len(slot.new_tokens)
        slot.stats.total_time_s = time.perf_counter() - slot.started
        if slot.request.on_done is not None:
            slot.request.on_done(slot.new_tokens, slot.finish, slot.stats)


def generate_all(runner, requests: list[SlotRequest], k: int = 0, *, join_at: list[int] | None = None,
                 mixed: str = "group", speculate_max_active: int = 0) -> list[tuple[list[int], str, Stats]]:
    """Run requests through one BatchLoop, request i joining at iteration join_at[i] (default 0) or
    as soon as a slot is free after it; returns (token ids, finish reason, stats) per request."""
    join_at = join_at or [0] * len(requests)
    results: list = [None] * len(requests)
    loop = BatchLoop(runner, k, mixed=mixed, speculate_max_active=speculate_max_active)
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
