"""The one scheduler every door (the ROS node, the HTTP door, the CLI) hands its requests to: a Job per request,
and the Scheduler, one thread that admits the jobs first in first out as the decoder has room, and answers each
with an Outcome as soon as its request ends.

The decoder (serving.Decoder: engine.Engine's slot loop, or backends/edgellm.py's Edge-LLM requests): waiting
jobs are added while it holds fewer than its capacity (the loop: they join free slots at an iteration boundary,
their prefill chunks between the other slots' decode calls; B=1 is one slot, so jobs run one at a time as a
FIFO) and the thread iterates it; each job's sink streams its text, answers the decoder's cancel questions
(the client's cancel, the deadline, stop) and takes its result. The decoder's load is the requests in it + the
jobs waiting here (the waiting count this thread hands to add and iterate). The scheduler holds the front
(serving.front_of the decoder): every request is checked and prepared there once, in submit; the doors
tokenize, detokenize and warm through it.

A scheduler holds at most capacity (the slots: requests running at once) + serve.queue_limit requests, counted
at submit: a request beyond them is answered "busy" at once (a burst of exactly that many to an idle node is
served in full, whether or not the thread has moved the first ones into slots yet),
serve.request_timeout_s how long a request may take from submit to finish (queue wait
included; past it, finish_reason "error"). A waiting job whose client is gone (its cancel_requested: an HTTP client
that disconnected or timed out, a cancelled ROS goal) or whose deadline passed leaves the queue at once, answered,
when the next request is submitted, when the queue is read, and when a door calls withdraw(): the held count is
of requests someone still waits for. cancel and stop are seen before each decode call; stop()
refuses what waits and cancels what runs. No door here: a door hands in its logger and answers with the
Outcome a job ends with. run_one is the same scheduling in the caller's thread for one request alone (the CLI's
`generate`, the tools, the tests).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from spec_edge import config as cfgmod
from spec_edge.runtime.front import Front, Prepared
from spec_edge.runtime.requests import GenerateRequest, GenerateResult, RequestError, Unavailable
from spec_edge.runtime.serving import Decoder, front_of

SHUTTING_DOWN = "the node is shutting down; retry on its successor"
REFUSED = ""               # finish_reason of a request that never ran (bad request, busy)


@dataclass
class Outcome:
    """What a door answers: the fields of the ROS service response / action result, the HTTP door's choice."""
    success: bool
    message: str = ""
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # sampling.TokenLogprobs per token (when asked)
    finish_reason: str = REFUSED
    stats: dict[str, Any] = field(default_factory=dict)
    tool_calls: list = field(default_factory=list)  # requests.ToolCall per call of the answer
    refusal: str = ""  # why a request never ran: "invalid" (the request), "busy" (full), "unavailable" (not serving)

    @classmethod
    def refused(cls, message: str, refusal: str = "invalid") -> "Outcome":
        return cls(success=False, message=message, refusal=refusal)

    def as_dict(self) -> dict[str, Any]:
        """The answer as one JSON object (`spec-edge generate --json`): the result's fields, its stats apart."""
        stats = {k: v for k, v in self.stats.items() if k not in ("queued_at_start", "speculation_off_reason")}
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "prompt_tokens": stats.get("prompt_tokens", 0), "message": self.message,
               "queued_at_start": self.stats.get("queued_at_start", 0),
               "speculation_off_reason": self.stats.get("speculation_off_reason", ""), "stats": stats}
        if self.tool_calls:
            out["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.logprobs:
            out["logprobs"] = [entry.as_dict() for entry in self.logprobs]
        return out


def result_stats(result: GenerateResult) -> dict[str, Any]:
    """The GenerationStats fields of an engine result: the loop's stats plus the queue's decision."""
    stats = result.stats.as_dict()
    stats.update(queued_at_start=result.queued_at_start, speculation_off_reason=result.speculation_off_reason)
    return stats


@dataclass
class Job:
    request: GenerateRequest
    on_text: Callable[[str, int], None] | None = None
    cancel_requested: Callable[[], bool] = lambda: False
    deadline: float = math.inf                      # time.monotonic() past which it ends as error
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    timed_out: bool = False
    prepared: Prepared | None = None                # the request as submit checked and prepared it
    result: GenerateResult | None = None            # the decoder's result (None: it never ran, or failed)
    error: Exception | None = None                  # why the front refused it, or the decoder failed on it

    def finish(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.done.set()


class Scheduler:
    """One thread that admits queued jobs into the decoder, first in first out, and serves them. front: the
    decoder's requests' (serving.front_of)."""

    def __init__(self, decoder: Decoder, cfg: cfgmod.Config, logger: Any, thread: bool = True,
                 front: Front | None = None):
        self.decoder = decoder
        self.front = front or front_of(decoder)
        self.cfg = cfg
        self.logger = logger
        self.capacity = decoder.capacity  # jobs running at once
        self._lock = threading.Lock()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # id(job) -> job, the jobs in the decoder
        self._held: list[Job] = []  # every job submit accepted that has not finished (waiting, admitted, running)
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self.current: Job | None = None
        self.served = 0
        self.refused_busy = 0
        self.speculation_off = 0  # requests the load policy (serve.speculate_k_by_load) gave less than their k
        self.last_stats: dict[str, Any] = {}
        self.others = 0  # requests the caller says wait elsewhere, added to the load (run_one's queued - 1)
        self._thread = threading.Thread(target=self._run, name="spec_edge-worker", daemon=True)
        if thread:  # without: the caller steps it (run_one)
            self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting that someone still waits for (not counting those running)."""
        with self._lock:
            self._drop_abandoned()
            return len(self._waiting)

    def withdraw(self) -> None:
        """A door learnt that a client is gone (its job's cancel_requested is true now): every waiting job
        whose client is gone or whose deadline passed is answered and leaves the queue now (a running one ends
        before its next decode call)."""
        with self._lock:
            self._drop_abandoned()

    def _drop_abandoned(self) -> None:
        """(under the lock) Answer and remove the waiting jobs nobody waits for any more, and forget finished ones."""
        if self._waiting:
            kept: collections.deque[Job] = collections.deque()
            for job in self._waiting:
                early = None if self._stopping else self._early_outcome(job)
                if early is None:
                    kept.append(job)
                else:
                    job.finish(early)
            self._waiting = kept
        self._held = [held for held in self._held if not held.done.is_set()]

    def submit(self, job: Job) -> bool:
        """Prepare the job's request (the front: every check, the tokenization, the grammar compile, once)
        and queue it; False (the job answered at once) for a request the front refuses (refusal "invalid": in the
        caller's thread, without taking a queue place), when stopping ("unavailable"), and when the node already
        holds capacity + serve.queue_limit unfinished requests ("busy")."""
        limit = self.cfg.serve.queue_limit
        try:
            job.prepared = self.front.prepare(job.request)
        except RequestError as err:
            job.error = err
            job.finish(Outcome.refused(str(err)))
            return False
        except Exception as err:  # a front that failed on a request: answer it (logged), keep serving
            job.error = err
            job.finish(self._failed(err))
            return False
        with self._lock:
            if self._stopping:
                job.finish(Outcome.refused(SHUTTING_DOWN, "unavailable"))
                return False
            self._drop_abandoned()
            if len(self._held) >= self.capacity + limit:
                self.refused_busy += 1
                job.finish(Outcome.refused(
                    f"busy: {len(self._held)} requests already run or wait ({self.capacity} slot(s) + "
                    f"serve.queue_limit={limit}); retry later", "busy"))
                return False
            job.deadline = time.monotonic() + self.cfg.serve.request_timeout_s
            self._held.append(job)
            self._waiting.append(job)
            self._wake.notify()
        return True

    def warm(self, system_prompt: str = "") -> int:
        """Put the chat prefix every request with this system prompt ("" = serve.system_prompt, then the template's
        default) shares into the decoder's cache (serve.reuse_prefix), before serving; its length in tokens."""
        if not self.cfg.serve.reuse_prefix:
            raise cfgmod.ConfigError("warming the cache needs serve.reuse_prefix: true")
        prefix = self.front.shared_prefix(system_prompt)
        if prefix:
            self.decoder.warm(prefix)
        return len(prefix)

    def stop(self, timeout: float) -> None:
        """Refuse what waits, cancel what runs (before its next decode call), join."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._wake.notify_all()
        for job in waiting:
            job.finish(Outcome.refused(SHUTTING_DOWN, "unavailable"))
        self._thread.join(timeout)

    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Admit what waits while the decoder has room, then one decoder iteration; waits (the thread) until there
        is something to do. False: stopped with nothing running."""
        decoder = self.decoder
        with self._lock:
            while not ((self._waiting and len(self._running) < self.capacity and not self._stopping)
                       or decoder.occupied or (self._stopping and not self._running)):
                self._wake.wait()  # woken by submit and stop
            if self._stopping and not self._running:
                return False
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.capacity and not self._stopping:
                admitted.append(self._waiting.popleft())
            waiting = len(self._waiting) + self.others
        for job in admitted:
            self._admit(job, waiting)
        if decoder.occupied:
            try:
                decoder.iterate(waiting)
            except Exception as err:  # the decoder failed: answer every job in it, keep serving
                self._fail_running(err)
        self.current = next(iter(self._running.values()), None)
        return True

    def _admit(self, job: Job, waiting: int) -> None:
        """Add job to the decoder (its answer at once when it was cancelled or timed out while it waited)."""
        if (early := self._early_outcome(job)) is not None:
            job.finish(early)
            return
        self._running[id(job)] = job
        try:
            self.decoder.add(job.prepared, _JobSink(self, job), waiting)
        except Exception as err:  # refused by the decoder, or it failed on a valid request: keep serving
            _JobSink(self, job).failed(err)

    def _done(self, job: Job, result: GenerateResult) -> None:
        self._running.pop(id(job), None)
        job.result = result
        job.finish(self._outcome(job, result))

    def _fail_running(self, err: Exception) -> None:
        failed = self._failed(err)
        self.decoder.clear()
        for job in list(self._running.values()):
            job.error = err
            job.finish(dataclasses.replace(failed))  # an Outcome of its own per job
        self._running.clear()

    def _failed(self, err: Exception) -> Outcome:
        """The answer when the decoder failed on a valid request (logged with its traceback; the node keeps serving)."""
        self.logger.error(f"generation failed: {err}\n{''.join(traceback.format_exception(err))}")
        return Outcome(success=False, message=f"generation failed: {type(err).__name__}: {err}", finish_reason="error")

    def _early_outcome(self, job: Job) -> Outcome | None:
        """The answer of a job cancelled or timed out before it started (None: start it)."""
        reason = self._cancel_reason(job)
        if reason is None:
            return None
        return Outcome(success=True, finish_reason="cancelled") if reason == "cancelled" else self._timeout_outcome(None)

    def _cancel_reason(self, job: Job) -> str | None:
        if self._stopping or job.cancel_requested():
            return "cancelled"
        if time.monotonic() > job.deadline:
            job.timed_out = True
            return "error"
        return None

    def _outcome(self, job: Job, result: GenerateResult) -> Outcome:
        """The answer to a job whose generation returned result (counted, its stats kept for diagnostics)."""
        self.served += 1
        if result.speculation_off_reason:
            self.speculation_off += 1
            self.logger.info(f"speculation policy: {result.speculation_off_reason}")
        stats = result_stats(result)
        self.last_stats = stats
        if job.timed_out:
            return self._timeout_outcome(result)
        outcome = Outcome(success=True, message=result.message, text=result.text,
                          num_tokens=len(result.token_ids), token_ids=list(result.token_ids),
                          logprobs=list(result.logprobs), finish_reason=result.finish_reason, stats=stats,
                          tool_calls=list(result.tool_calls))
        if self._stopping and result.finish_reason == "cancelled":
            outcome.success = False
            outcome.message = "the node shut down during the generation; retry on its successor"
        return outcome

    def _timeout_outcome(self, result: GenerateResult | None) -> Outcome:
        limit = self.cfg.serve.request_timeout_s
        return Outcome(
            success=False, finish_reason="error",
            message=(f"timed out: the request was not finished within serve.request_timeout_s={limit} s "
                     "(queue wait included); ask for fewer max_new_tokens or raise the timeout"),
            text=result.text if result else "", num_tokens=len(result.token_ids) if result else 0,
            token_ids=list(result.token_ids) if result else [],
            stats=result_stats(result) if result else {})


class _JobSink:
    """A job's serving.Sink: its on_text, the scheduler's cancel reasons, its answer."""

    def __init__(self, scheduler: Scheduler, job: Job):
        self.scheduler, self.job = scheduler, job

    def on_text(self, delta: str, n_tokens: int) -> None:
        if self.job.on_text is not None:
            self.job.on_text(delta, n_tokens)

    def cancel_reason(self) -> str | None:
        return self.scheduler._cancel_reason(self.job)

    def done(self, result: GenerateResult) -> None:
        self.scheduler._done(self.job, result)

    def failed(self, err: Exception) -> None:
        self.scheduler._running.pop(id(self.job), None)
        self.job.error = err
        self.job.finish(Outcome.refused(str(err)) if isinstance(err, RequestError) else Outcome.refused(
            str(err), "unavailable") if isinstance(err, Unavailable) else self.scheduler._failed(err))


def serve_alone(decoder: Decoder, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                cancel: Callable[[], bool] = lambda: False, queued: int = 1,
                logger: Any = logging.getLogger("spec_edge")) -> Job:
    """Serve one request alone through an idle decoder (serving.Decoder), stepping a Scheduler in the caller's
    thread: admitted, iterated, cancelled and finished as every door's requests are; its Job, answered (its
    outcome, as every door's). queued: the load as it runs, itself included (what serve.speculate_k_by_load gives
    a k for)."""
    if decoder.occupied:
        raise RuntimeError("run_one() runs a request alone, but the decoder is serving others (the scheduler's)")
    scheduler = Scheduler(decoder, decoder.cfg, logger, thread=False)
    scheduler.others = queued - 1
    job = Job(request, on_text, cancel)
    scheduler.submit(job)
    try:
        while not job.done.is_set():
            scheduler._step()
    except BaseException:  # interrupted (Ctrl-C): the request leaves the decoder
        decoder.clear()
        raise
    return job


def run_one(decoder: Decoder, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
            cancel: Callable[[], bool] = lambda: False, queued: int = 1,
            logger: Any = logging.getLogger("spec_edge")) -> GenerateResult:
    """serve_alone's request, its decoder's GenerateResult (the tools, the tests). Raises what refused it (a
    RequestError: nothing run) or what the decoder failed with."""
    job = serve_alone(decoder, request, on_text, cancel, queued, logger)
    if job.error is not None:
        raise job.error
    if job.result is None:
        raise RuntimeError(f"the request ended before it ran: {job.outcome.finish_reason} {job.outcome.message}")
    return job.result
