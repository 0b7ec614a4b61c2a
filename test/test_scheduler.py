"""The one Scheduler (spec_edge/runtime/scheduler.py) without a door, over a decoder (serving.Decoder): it adds
queued jobs while the decoder has room (the Engine's loop: free slots, B=1 one at a time, first in first out;
a double here of capacity N) and tells it what waits; every request goes through the front once. (Edge-LLM's
decoder through the scheduler: test_edgellm_runtime.py.)"""
from __future__ import annotations

import threading
import time

import pytest

from spec_edge.runtime.scheduler import Job, Scheduler
from spec_edge.runtime.requests import GenerateRequest, GenerateResult
from spec_edge.runtime.stats import Stats


class Log:
    def error(self, message):
        raise AssertionError(message)

    def info(self, message):
        pass


class Held:
    """A serving.Decoder of capacity requests at once whose requests end only once released (each answers its
    prompt): the scheduler's admission and load without a model."""

    def __init__(self, cfg, capacity: int):
        self.cfg, self.capacity = cfg, capacity
        self.release = threading.Event()
        self.sinks: list = []
        self.most = 0
        self.queued: list[int] = []  # the load as each request started, itself included

    def prepare(self, request):
        """(its own front) Every request is one it serves, prepared as it is."""
        return request

    @property
    def occupied(self) -> int:
        return len(self.sinks)

    def add(self, prepared, sink, waiting):
        self.sinks.append((prepared, sink))
        self.most = max(self.most, self.occupied)
        self.queued.append(self.occupied + waiting)

    def iterate(self, waiting):
        if self.release.wait(0.01):
            sinks, self.sinks = self.sinks, []
            for request, sink in sinks:
                sink.done(GenerateResult(text=request.prompt, token_ids=[1], finish_reason="length", stats=Stats()))

    def clear(self):
        self.sinks = []


def run_jobs(worker, n):
    jobs = [Job(request=GenerateRequest(prompt=f"p{i}")) for i in range(n)]
    for job in jobs:
        assert worker.submit(job)
    return jobs


@pytest.mark.parametrize("capacity", [3, 1])
def test_a_decoder_runs_up_to_its_capacity_at_once(tiny_cfg, capacity):
    backend = Held(tiny_cfg, capacity)
    worker = Scheduler(backend, tiny_cfg, Log(), front=backend)
    try:
        jobs = run_jobs(worker, 5)
        deadline = time.monotonic() + 5
        while backend.occupied < capacity and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert backend.occupied == capacity and worker.queue_depth == 5 - capacity
        backend.release.set()
        for job in jobs:
            assert job.done.wait(10) and job.outcome.success and job.outcome.text == job.request.prompt
        assert backend.most == capacity and worker.served == 5
        assert max(backend.queued) > 1  # the load as it started: itself, those running and those behind it
    finally:
        backend.release.set()
        worker.stop(5)


def test_stop_refuses_what_waits_and_cancels_what_runs(tiny_engine):
    """Over the Engine's loop (B=1: one slot): the first job runs, the others wait and are refused on stop;
    the running one ends cancelled."""
    from spec_edge.runtime.scheduler import SHUTTING_DOWN

    worker = Scheduler(tiny_engine, tiny_engine.cfg, Log())
    started = threading.Event()
    jobs = [Job(request=GenerateRequest(prompt="Move the arm", max_new_tokens=100, speculate=False),
                on_text=lambda delta, n: started.set()) for _ in range(3)]
    for job in jobs:
        assert worker.submit(job)
    assert started.wait(30)
    assert worker.queue_depth == 2 and tiny_engine.loop.waiting == 2  # the loop's load counts them
    worker.stop(30)
    assert jobs[0].done.is_set() and jobs[0].outcome.finish_reason == "cancelled"
    assert [job.outcome.message for job in jobs[1:]] == [SHUTTING_DOWN] * 2
    assert not tiny_engine.loop.occupied


@pytest.mark.parametrize("capacity", [3, 1])
def test_capacity_is_slots_plus_queue_counted_at_submit(tiny_cfg, capacity):
    """D3: a burst of exactly capacity (requests at once) + serve.queue_limit is taken in full, before the
    worker has moved any of it into a slot; one more is "busy"; once they finished there is room again."""
    cfg = tiny_cfg.replace(**{"serve.queue_limit": 2})
    backend = Held(cfg, capacity)
    worker = Scheduler(backend, cfg, Log(), front=backend)
    try:
        room = worker.capacity + 2
        jobs = run_jobs(worker, room)
        extra = Job(request=GenerateRequest(prompt="one more"))
        assert not worker.submit(extra)
        assert extra.outcome.message.startswith(f"busy: {room} requests already run or wait")
        assert worker.refused_busy == 1
        backend.release.set()
        for job in jobs:
            assert job.done.wait(10) and job.outcome.success
        assert all(job.outcome.success for job in run_jobs(worker, room) if job.done.wait(10))
    finally:
        backend.release.set()
        worker.stop(5)


def test_capacity_over_the_engine_loop(tiny_engine):
    """The same over the Engine's loop (B=1: capacity 1 slot + queue_limit)."""
    cfg = tiny_engine.cfg.replace(**{"serve.queue_limit": 2})
    worker = Scheduler(tiny_engine, cfg, Log())
    try:
        jobs = [Job(request=GenerateRequest(prompt="Move the arm", max_new_tokens=20, speculate=False))
                for _ in range(3)]
        assert all(worker.submit(job) for job in jobs)
        assert not worker.submit(Job(request=GenerateRequest(prompt="one more")))
        for job in jobs:
            assert job.done.wait(60) and job.outcome.success and job.outcome.num_tokens > 0
    finally:
        worker.stop(30)


def test_a_request_is_tokenized_and_its_grammar_compiled_once(tiny_engine, monkeypatch):
    """Through the scheduler a request goes through the front once (at submit): one tokenization, one grammar
    compile, and the engine starts from what the front prepared."""
    counts = {"encode": 0, "compile": 0}

    def counted(name, call):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(tiny_engine.tokenizer, "encode", counted("encode", tiny_engine.tokenizer.encode))
    monkeypatch.setattr(tiny_engine.grammars, "compile", counted("compile", tiny_engine.grammars.compile))
    worker = Scheduler(tiny_engine, tiny_engine.cfg, Log())
    try:
        job = Job(request=GenerateRequest(prompt="Move the arm", regex="(left|right) [0-9]{1,3} once", max_new_tokens=8))
        assert worker.submit(job) and job.done.wait(60) and job.outcome.success, job.outcome
        assert counts == {"encode": 1, "compile": 1}
    finally:
        worker.stop(30)


def test_a_front_that_fails_answers_the_request_and_keeps_serving(tiny_engine, monkeypatch):
    """A failure of the front other than a refusal (a bug, a tokenizer error) answers that request with an error at
    submit, logged; the scheduler, and so the node, serves the next one."""
    logged = []

    class Errors(Log):
        def error(self, message):
            logged.append(message)

    worker = Scheduler(tiny_engine, tiny_engine.cfg, Errors())
    prepare = worker.front.prepare

    def fails_once(request):
        monkeypatch.setattr(worker.front, "prepare", prepare)
        raise KeyError("a field the front did not expect")

    monkeypatch.setattr(worker.front, "prepare", fails_once)
    try:
        bad = Job(request=GenerateRequest(prompt="Move the arm", max_new_tokens=4))
        assert not worker.submit(bad) and bad.done.is_set()
        assert not bad.outcome.success and bad.outcome.finish_reason == "error" and "KeyError" in bad.outcome.message
        assert logged and "KeyError" in logged[0]
        good = Job(request=GenerateRequest(prompt="Move the arm", max_new_tokens=4))
        assert worker.submit(good) and good.done.wait(60) and good.outcome.success, good.outcome
    finally:
        worker.stop(30)


def test_a_waiting_request_whose_client_is_gone_leaves_the_queue_at_once(tiny_cfg):
    """The slots full and the queue full of requests whose clients then gave up (an HTTP client that timed out, a
    cancelled goal) or whose deadline passed: the next request is taken at once, not "busy" until a slot frees;
    withdraw() answers the abandoned ones now (cancelled / timed out) and the queue counts only live ones."""
    cfg = tiny_cfg.replace(**{"serve.queue_limit": 4})
    backend = Held(cfg, 2)
    worker = Scheduler(backend, cfg, Log(), front=backend)
    try:
        running = run_jobs(worker, 2)
        deadline = time.monotonic() + 5
        while backend.occupied < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = threading.Event()
        queued = [Job(request=GenerateRequest(prompt=f"q{i}"), cancel_requested=gone.is_set) for i in range(3)]
        late = Job(request=GenerateRequest(prompt="late"))
        for job in queued + [late]:
            assert worker.submit(job)
        assert not worker.submit(Job(request=GenerateRequest(prompt="full")))  # 2 running + 4 waiting
        gone.set()
        late.deadline = time.monotonic() - 1  # past serve.request_timeout_s while it waited
        worker.withdraw()
        assert all(job.done.is_set() and job.outcome.finish_reason == "cancelled" for job in queued)
        assert late.done.is_set() and "timed out" in late.outcome.message
        assert worker.queue_depth == 0 and backend.occupied == 2  # the running ones run on
        fresh = [Job(request=GenerateRequest(prompt=f"new{i}")) for i in range(4)]
        assert all(worker.submit(job) for job in fresh)  # the four places are free again
        # a client gone with no withdraw() call: the next submit drops it before it counts the places
        fresh[0].cancel_requested = lambda: True
        assert worker.submit(Job(request=GenerateRequest(prompt="after")))
        assert fresh[0].done.is_set() and fresh[0].outcome.finish_reason == "cancelled"
        backend.release.set()
        for job in running + fresh[1:]:
            assert job.done.wait(10) and job.outcome.success
    finally:
        backend.release.set()
        worker.stop(5)
