"""The queue in front of the engine: a Job per request, and the Worker, one thread that runs the
jobs first in first out.

serve.queue_limit bounds what waits (a request beyond it is answered "busy" at once),
serve.request_timeout_s how long a request may take from submit to finish (queue wait
included; past it, finish_reason "error"). stop() refuses what waits and cancels what runs.
No rclpy here: the node hands in its logger and answers with the Outcome a job ends with.
"""
from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from spec_edge import config as cfgmod
from spec_edge.ros2.messages import Outcome, result_stats

SHUTTING_DOWN = "the node is shutting down; retry on its successor"


@dataclass
class Job:
    request: Any                                    # engine.GenerateRequest
    on_text: Callable[[str, int], None] | None = None
    cancel_requested: Callable[[], bool] = lambda: False
    deadline: float = math.inf                      # time.monotonic() past which it ends as error
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    timed_out: bool = False
    queued_at_start: int = 0                        # requests queued as it started, itself included

    def finish(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.done.set()


class Worker:
    """One thread that runs queued jobs through the engine, first in first out."""

    def __init__(self, engine: Any, cfg: cfgmod.Config, logger: Any):
        self.engine = engine
        self.cfg = cfg
        self.logger = logger
        self._lock = threading.Lock()
        self._waiting: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self.current: Job | None = None
        self.served = 0
        self.refused_busy = 0
        self.speculation_off = 0  # requests the load policy (serve.speculate_k_by_load) gave less than their k
        self.last_stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="spec_edge-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return len(self._waiting)

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and the job answered "busy") when serve.queue_limit are waiting."""
        limit = self.cfg.serve.queue_limit
        with self._lock:
            if self._stopping:
                job.finish(Outcome.refused(SHUTTING_DOWN))
                return False
            if len(self._waiting) >= limit:
                self.refused_busy += 1
                job.finish(Outcome.refused(
                    f"busy: {len(self._waiting)} requests already wait (serve.queue_limit={limit}); "
                    "retry later"))
                return False
            job.deadline = time.monotonic() + self.cfg.serve.request_timeout_s
            self._waiting.append(job)
            self._wake.notify()
        return True

    def stop(self, timeout: float) -> None:
        """Refuse what waits, cancel what runs (between speculative steps), join."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._wake.notify_all()
        for job in waiting:
            job.finish(Outcome.refused(SHUTTING_DOWN))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                job.queued_at_start = len(self._waiting) + 1
                self.current = job
            try:
                job.finish(self._generate(job))
            finally:
                with self._lock:
                    self.current = None

    def _cancel_reason(self, job: Job) -> str | None:
        if self._stopping or job.cancel_requested():
            return "cancelled"
        if time.monotonic() > job.deadline:
            job.timed_out = True
            return "error"
        return None

    def _generate(self, job: Job) -> Outcome:
        from spec_edge.runtime.requests import RequestError
        early = self._cancel_reason(job)
        if early == "cancelled":
            return Outcome(success=True, finish_reason="cancelled")
        if early is not None:
            return self._timeout_outcome(job, None)
        try:
            result = self.engine.generate(job.request, on_text=job.on_text,
                                          cancel=lambda: self._cancel_reason(job), queued=job.queued_at_start)
        except RequestError as err:
            return Outcome.refused(str(err))
        except Exception as err:  # the engine failed on a valid request: report it, keep serving
            self.logger.error(f"generation failed: {err}\n{traceback.format_exc()}")
            return Outcome(success=False, message=f"generation failed: {type(err).__name__}: {err}",
                           finish_reason="error")
        return self._outcome(job, result)

    def _outcome(self, job: Job, result: Any) -> Outcome:
        """The answer to a job whose generation returned result (counted, its stats kept for diagnostics)."""
        self.served += 1
        if result.speculation_off_reason:
            self.speculation_off += 1
            self.logger.info(f"speculation policy: {result.speculation_off_reason}")
        stats = result_stats(result)
        self.last_stats = stats
        if job.timed_out:
            return self._timeout_outcome(job, result)
        outcome = Outcome(success=True, message=getattr(result, "message", ""), text=result.text,
                          num_tokens=len(result.token_ids), token_ids=list(result.token_ids),
                          logprobs=list(result.logprobs), finish_reason=result.finish_reason, stats=stats)
        if self._stopping and result.finish_reason == "cancelled":
            outcome.success = False
            outcome.message = "the node shut down during the generation; retry on its successor"
        return outcome

    def _timeout_outcome(self, job: Job, result: Any) -> Outcome:
        limit = self.cfg.serve.request_timeout_s
        return Outcome(
            success=False, finish_reason="error",
            message=(f"timed out: the request was not finished within serve.request_timeout_s={limit} s "
                     "(queue wait included); ask for fewer max_new_tokens or raise the timeout"),
            text=result.text if result else "", num_tokens=len(result.token_ids) if result else 0,
            token_ids=list(result.token_ids) if result else [],
            stats=result_stats(result) if result else {})
