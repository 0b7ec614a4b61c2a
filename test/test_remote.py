"""runtime.backend remote against a real second process: `spec-edge http` on loopback serving the session's tiny
model (remote.kind spec_edge), driven through the one Scheduler as every door drives a decoder. Greedy answers equal
the local engine's token for token, streamed; a cancel frees the server's slot within 1 s; a refused capability
gets the front's words; the server stopped -> the fallback answers within 2 s and says so (without a fallback:
"remote unavailable" within 1 s); the server back -> served remotely again within the probe interval. Tool calls
pass through (the embedded default's server). The node over the same server: ros/test_node_remote.py."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from remote_server import REPO, Server, free_port

from spec_edge import config as cfgmod
from spec_edge.runtime.decoders import open_decoder
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.scheduler import Job, Scheduler, run_one

PROBE_S = 0.5
REQUESTS = {"chat": GenerateRequest(messages=(("user", "Move the arm to the left"),), max_new_tokens=24, temperature=0),
            "raw": GenerateRequest(prompt="The robot picks up", chat=False, max_new_tokens=16, temperature=0)}


def remote_cfg(tiny_cfg, server: Server, fallback: str) -> cfgmod.Config:
    return tiny_cfg.replace(**{"runtime.backend": "remote", "remote.base_url": f"{server.url}/v1",
                               "remote.model": tiny_cfg.runtime.profile, "remote.kind": "spec_edge",
                               "remote.fallback": fallback, "remote.probe_interval_s": PROBE_S})


@pytest.fixture(scope="module")
def served(tiny_cfg, remote):
    """(scheduler, decoder) of a remote decoder with the local fallback."""
    decoder = open_decoder(remote_cfg(tiny_cfg, remote, "local"), progress=lambda m: None)
    scheduler = Scheduler(decoder, decoder.cfg, logging.getLogger("test_remote"))
    yield scheduler, decoder
    scheduler.stop(1.0)
    decoder.close()


def ask(scheduler: Scheduler, request: GenerateRequest, **job) -> Job:
    job = Job(request, **job)
    scheduler.submit(job)
    assert job.done.wait(30), "no answer in 30 s"
    return job


def test_greedy_equal_streamed(served, tiny_engine, remote):
    scheduler, decoder = served
    before = remote.metric('spec_edge_http_requests_total{outcome="success"}')
    for name, request in REQUESTS.items():
        alone = run_one(tiny_engine, request)
        pieces: list[str] = []
        job = ask(scheduler, request, on_text=lambda delta, n: pieces.append(delta))
        out = job.outcome
        assert out.success and out.stats["served_by"] == "remote", out
        assert out.token_ids == alone.token_ids and out.text == alone.text, name
        assert "".join(pieces) == out.text and len(pieces) > 1, name
    assert remote.metric('spec_edge_http_requests_total{outcome="success"}') == before + len(REQUESTS)
    assert decoder.info()["remote"]["state"] == "closed"


def test_without_fallback_the_server_renders(tiny_cfg, tiny_engine, remote):
    """No local model: the front hands the checked messages over (Capabilities.renders, no prompt ids) and the
    server renders and answers them, token for token the local engine's; tokenizing is refused with what to do."""
    decoder = open_decoder(remote_cfg(tiny_cfg, remote, ""), progress=lambda m: None)
    scheduler = Scheduler(decoder, decoder.cfg, logging.getLogger("test_remote"))
    try:
        assert decoder.tokenizer is None and decoder.capabilities.renders
        prepared = scheduler.front.prepare(REQUESTS["chat"])
        assert prepared.prompt_ids == [] and [m.role for m in prepared.messages] == ["user"]
        for name, request in REQUESTS.items():
            alone = run_one(tiny_engine, request)
            out = ask(scheduler, request).outcome
            assert out.success and out.stats["served_by"] == "remote", out
            assert (out.text, out.token_ids) == (alone.text, alone.token_ids), name
        with pytest.raises(RequestError, match="has no tokenizer here .*remote.fallback local"):
            scheduler.front.tokenize("hi", chat=True)
    finally:
        scheduler.stop(1.0)
        decoder.close()


def test_guided_json_passes_through(served, tiny_engine):
    """The schema goes to the server as response_format; its constrained answer is the local's, token for token.
    (Tool calls: test_tool_calls_pass_through, on the embedded default: the tiny model's 128-token context cannot
    hold the tools' prompt.)"""
    scheduler, _ = served
    place = {"type": "object", "properties": {"place": {"enum": ["dock", "kitchen"]}}, "required": ["place"],
             "additionalProperties": False}
    request = GenerateRequest(prompt="Where to?", json_schema=json.dumps(place), max_new_tokens=40, temperature=0)
    alone = run_one(tiny_engine, request)
    out = ask(scheduler, request).outcome
    assert out.success and out.stats["served_by"] == "remote", out
    assert (out.text, out.token_ids, out.finish_reason) == (alone.text, alone.token_ids, alone.finish_reason)
    assert json.loads(out.text)["place"] in ("dock", "kitchen")


def test_cancel_frees_the_remote_slot(served, remote):
    scheduler, _ = served
    cancelled = threading.Event()
    gone = remote.metric('spec_edge_http_requests_total{outcome="disconnected"}')
    request = GenerateRequest(prompt="Navigate to the kitchen", max_new_tokens=96, ignore_eos=True, temperature=0)
    job = ask(scheduler, request, on_text=lambda delta, n: cancelled.set(), cancel_requested=cancelled.is_set)
    at = time.monotonic()
    assert job.outcome.finish_reason == "cancelled" and job.outcome.num_tokens < 96, job.outcome
    while remote.metric("spec_edge_http_in_flight") > 0:
        assert time.monotonic() - at < 1.0, "the remote still runs the cancelled request after 1 s"
        time.sleep(0.02)
    assert remote.metric('spec_edge_http_requests_total{outcome="disconnected"}') == gone + 1


def test_configure_checks_the_server(tiny_cfg, remote):
    cfg = remote_cfg(tiny_cfg, remote, "")
    with pytest.raises(cfgmod.ConfigError, match="does not serve remote.model 'nope'; it lists tiny: set remote.model"):
        open_decoder(cfg.replace(**{"remote.model": "nope"}), progress=lambda m: None)
    with pytest.raises(cfgmod.ConfigError, match="does not answer GET /models .*: start the server"):
        open_decoder(cfg.replace(**{"remote.base_url": f"http://127.0.0.1:{free_port()}/v1"}),
                           progress=lambda m: None)


def test_refused_capability(served, tiny_cfg, remote):
    scheduler, _ = served
    job = ask(scheduler, GenerateRequest(prompt="hi", logprobs=2))
    assert not job.outcome.success and job.outcome.refusal == "invalid"
    assert job.outcome.message.startswith("logprobs: remote spec_edge (local fallback)'s runtime has no such option")
    edgellm = RemoteDecoderFront(tiny_cfg, remote, "edgellm")
    with pytest.raises(RequestError, match="a json_schema runs on runtime.backend: onnxruntime only"):
        edgellm.prepare(GenerateRequest(prompt="hi", json_schema='{"type": "object"}'))


def RemoteDecoderFront(tiny_cfg, remote, kind: str):
    """The front of a remote decoder of another kind, without a fallback (no local tokenizer)."""
    from spec_edge.runtime.backends.remote import RemoteDecoder
    from spec_edge.runtime.backends.remote_link import Link
    from spec_edge.runtime.serving import front_of

    cfg = remote_cfg(tiny_cfg, remote, "").replace(**{"remote.kind": kind})
    link = Link(cfg.remote)
    try:
        return front_of(RemoteDecoder(cfg, link, None))
    finally:
        link.close()


def test_server_down_then_back(served, tiny_cfg, remote):
    """Killed while it streams: that answer fails, not restarted locally. Stopped: the fallback answers within 2 s
    and says so, a decoder without one says "remote unavailable" within 1 s; started again: served remotely within
    the probe interval of its being up."""
    scheduler, decoder = served
    alone = open_decoder(remote_cfg(tiny_cfg, remote, ""), progress=lambda m: None)
    bare = Scheduler(alone, alone.cfg, logging.getLogger("test_remote"))
    request = REQUESTS["chat"]
    killed = threading.Event()

    def kill(delta: str, n: int) -> None:  # the server dies while it streams: the answer is not restarted locally
        if not killed.is_set():
            killed.set()
            remote.proc.kill()

    long = GenerateRequest(prompt="Navigate to the kitchen", max_new_tokens=96, ignore_eos=True, temperature=0)
    out = ask(scheduler, long, on_text=kill).outcome
    assert out.refusal == "unavailable" and "streamed pieces" in out.message and "not restarted" in out.message, out
    remote.stop()
    try:
        at = time.monotonic()
        out = ask(scheduler, request).outcome
        assert time.monotonic() - at < 2.0 and out.success and out.stats["served_by"] == "local", out
        assert out.message.startswith("answered by the local model: ")
        at = time.monotonic()
        out = ask(bare, request).outcome
        assert time.monotonic() - at < 1.0 and out.refusal == "unavailable", out
        assert out.message.startswith(f"remote unavailable: {remote.url}/v1 (APIConnectionError"), out
    finally:
        remote.start()
    up = time.monotonic()
    while (out := ask(scheduler, request).outcome).stats["served_by"] != "remote":
        assert time.monotonic() - up < PROBE_S + 1.0, "still served locally past the probe interval"
        time.sleep(0.05)
    assert decoder.info()["remote"]["state"] == "closed" and decoder.info()["remote"]["errors"] >= 1
    bare.stop(1.0)
    alone.close()


@pytest.mark.release
@pytest.mark.real_model("fp32")
def test_tool_calls_pass_through(tmp_path):
    """Tools go to the server as OpenAI tools (the embedded default, fp32: the tiny model's context cannot hold the
    tools' prompt); the calls it constrains and parses come back as the local engine's, name and arguments (ids are
    made per request)."""
    import sys

    sys.path.insert(0, str(REPO / "examples"))
    from robot_tools import SYSTEM_PROMPT, TOOLS

    real = cfgmod.Config().replace(**{"graphs.weights": "fp32", "graphs.batch_slots": 1, "speculative.k": 4,
                                      "runtime.engine_dir": str(REPO / "engines")})
    server = Server(real, tmp_path)
    server.start()
    try:
        # a spec_edge server sends the calls whole, at the end: the first piece is the whole answer
        cfg = remote_cfg(real, server, "local").replace(**{"remote.first_token_timeout_s": 300.0})
        decoder = open_decoder(cfg, progress=lambda m: None)
        try:
            request = GenerateRequest(messages=(("system", SYSTEM_PROMPT), ("user", "Go to the kitchen.")),
                                      tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                      max_new_tokens=64, temperature=0)
            alone, remote = run_one(decoder.local, request), run_one(decoder, request)
        finally:
            decoder.close()
    finally:
        server.stop()
    assert remote.stats.served_by == "remote" and remote.finish_reason == alone.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in remote.tool_calls] == [(c.name, c.arguments) for c in alone.tool_calls]
    assert remote.tool_calls and remote.token_ids == alone.token_ids
