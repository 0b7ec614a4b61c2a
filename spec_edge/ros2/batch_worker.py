"""The queue in front of a BatchEngine (graphs.batch_slots > 1): in-flight batching.

Same contract as worker.Worker per request (serve.queue_limit answers "busy", serve.request_timeout_s
counts from submit, cancel and stop are seen between iterations, streaming per request), but one
thread runs the engine's BatchLoop: waiting jobs join free slots at each iteration boundary (their
prefill chunks between the other slots' decode calls), a job is answered as soon as its request
leaves its slot, and the slot takes the next job. No rclpy here.
"""
from __future__ import annotations

import traceback
from typing import Any

from spec_edge import config as cfgmod
from spec_edge.ros2.messages import Outcome
from spec_edge.ros2.worker import Job, Worker


class BatchWorker(Worker):
    """One thread that iterates the engine's BatchLoop, admitting queued jobs into free slots."""

    def __init__(self, engine: Any, cfg: cfgmod.Config, logger: Any):
        self._running: dict[int, Job] = {}  # id(job) -> job, the jobs in slots (before the thread starts)
        super().__init__(engine, cfg, logger)

    def _run(self) -> None:
        loop = self.engine.loop
        while True:
            with self._lock:
                while not self._waiting and not loop.occupied and not self._stopping:
                    self._wake.wait()
                if self._stopping and not loop.occupied:
                    return
                admitted = []
                while self._waiting and loop.free - len(admitted) > 0 and not self._stopping:
                    job = self._waiting.popleft()
                    job.queued_at_start = len(self._waiting) + 1
                    admitted.append(job)
            for job in admitted:
                self._admit(job)
            if loop.occupied:
                try:
                    loop.iterate()
                except Exception as err:  # the engine failed: answer every job in a slot, keep serving
                    self._fail_running(err)
            self.current = next(iter(self._running.values()), None)

    def _admit(self, job: Job) -> None:
        from spec_edge.runtime.requests import RequestError

        early = self._cancel_reason(job)
        if early is not None:
            job.finish(Outcome(success=True, finish_reason="cancelled") if early == "cancelled"
                       else self._timeout_outcome(job, None))
            return
        try:
            request = self.engine.start(job.request, on_text=job.on_text, cancel=lambda: self._cancel_reason(job),
                                        on_result=lambda result: self._done(job, result))
            self.engine.loop.add(request)
        except RequestError as err:
            job.finish(Outcome.refused(str(err)))
            return
        except Exception as err:  # the engine failed on a valid request: report it, keep serving
            self.logger.error(f"generation failed: {err}\n{traceback.format_exc()}")
            job.finish(Outcome(success=False, message=f"generation failed: {type(err).__name__}: {err}",
                               finish_reason="error"))
            return
        self._running[id(job)] = job

    def _done(self, job: Job, result: Any) -> None:
        self._running.pop(id(job), None)
        job.finish(self._outcome(job, result))

    def _fail_running(self, err: Exception) -> None:
        self.logger.error(f"generation failed: {err}\n{traceback.format_exc()}")
        self.engine.loop.clear()
        for job in list(self._running.values()):
            job.finish(Outcome(success=False, message=f"generation failed: {type(err).__name__}: {err}",
                               finish_reason="error"))
        self._running.clear()
