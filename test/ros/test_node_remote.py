"""The node with runtime.backend remote against a second process running `spec-edge http` on loopback (the
session's tiny model, remote.kind spec_edge): two node processes on the module's domain, one with
remote.fallback local (namespace fb) and one without (namespace bare), called through the ROS service and action
by a client in this process. Greedy answers equal the local engine's token for token (and the remote speculated);
a cancelled goal frees the server's slot within 1 s of the ROS cancel; a refused capability gets the front's words
and the node keeps serving; the server stopped -> the fallback answers within 2 s and says so, the other node
answers "remote unavailable" within 1 s; the server back -> served remotely again within the probe interval."""
from __future__ import annotations

import threading
import time

import pytest

from rosutil import Server as NodeServer
from rosutil import engine_request, write_params
from spec_edge import config as cfgmod
from spec_edge.runtime.scheduler import run_one

PROBE_S = 0.5
ASK = dict(prompt="Move the arm to the left", max_new_tokens=24, temperature=0.0)
LONG = dict(prompt="Navigate to the kitchen", max_new_tokens=80, ignore_eos=True, temperature=0.0)
LOCAL = "answered by the local model: "


@pytest.fixture(scope="module")
def nodes(tiny_cfg, remote, module_env, tmp_path_factory):
    """{"fb": client, "bare": client}: GenerateClients (this process, the module's domain) of the two nodes, each
    started (in parallel) as `spec-edge serve --params FILE --namespace NS`."""
    import sys

    import rclpy

    from spec_edge.ros2.client import GenerateClient

    defaults = cfgmod.to_params(cfgmod.Config())
    params = {k: v for k, v in cfgmod.to_params(tiny_cfg).items() if v != defaults[k]}
    params.update({"runtime.backend": "remote", "remote.base_url": f"{remote.url}/v1", "remote.kind": "spec_edge",
                   "remote.model": tiny_cfg.runtime.profile, "remote.probe_interval_s": PROBE_S,
                   "remote.breaker_failures": 1})
    tmp = tmp_path_factory.mktemp("nodes")
    servers = [NodeServer(module_env, write_params(tmp / f"{ns}.yaml", {**params, "remote.fallback": fallback}),
                          tmp / f"{ns}.log", [sys.executable, "-m", "spec_edge.cli", "serve", "--params",
                                              str(tmp / f"{ns}.yaml"), "--namespace", ns])
               for ns, fallback in (("fb", "local"), ("bare", ""))]
    failed: list[Exception] = []
    starting = [threading.Thread(target=lambda s=s: _start(s, failed)) for s in servers]
    for thread in starting:
        thread.start()
    for thread in starting:
        thread.join()
    if failed:
        for server in servers:
            server.stop()
        raise failed[0]
    rclpy.init(domain_id=int(module_env["ROS_DOMAIN_ID"]))
    clients = {ns: GenerateClient(namespace=ns, node_name=f"client_{ns}", wait_timeout=60, timeout=60)
               for ns in ("fb", "bare")}
    yield clients
    for client in clients.values():
        client.close()
    rclpy.shutdown()
    for server in servers:
        server.stop()


def _start(server: NodeServer, failed: list[Exception]) -> None:
    try:
        server.start(timeout=120)
    except Exception as err:  # noqa: BLE001 - raised by the fixture
        failed.append(err)


def answer(client, **fields) -> tuple[dict, float]:
    """The node's response to one service call, as a dict, and the seconds it took."""
    from spec_edge.ros2.messages import response_to_dict

    started = time.monotonic()
    response = client.call(**fields)
    return response_to_dict(response), time.monotonic() - started


def test_greedy_equal_and_a_refusal(nodes, tiny_engine):
    """Both nodes (with a local model and without one, where the server renders the chat) answer the local engine's
    tokens, and the remote speculated as the local engine did; a capability the remote decoder lacks is refused in
    the front's words and the node keeps serving."""
    alone = run_one(tiny_engine, engine_request(**ASK))
    want = (alone.text.split("\x00")[0], alone.token_ids, alone.stats.drafted)  # a ROS string ends at a NUL
    assert alone.stats.drafted > 0
    for ns, client in nodes.items():
        out, _ = answer(client, **ASK)
        assert out["success"] and out["message"] == "", (ns, out)
        assert (out["text"], out["token_ids"], out["stats"]["drafted"]) == want, ns
    refused, _ = answer(nodes["fb"], **ASK, logprobs=2)
    assert not refused["success"], refused
    assert refused["message"].startswith("logprobs: remote spec_edge (local fallback)'s runtime has no such option"), \
        refused["message"]
    out, _ = answer(nodes["fb"], **ASK)
    assert out["success"] and out["text"] == want[0]


def test_cancel_frees_the_remote_slot(nodes, remote):
    """The action streams the remote's pieces; a ROS cancel closes the HTTP stream: the server counts its client
    gone and has nothing in flight within 1 s of the cancel (its /metrics, read every 20 ms)."""
    gone_name = 'spec_edge_http_requests_total{outcome="disconnected"}'
    gone = remote.metric(gone_name)
    samples: list[tuple[float, float, float]] = []  # (time, in flight, disconnected)
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        while watching.is_set():
            flight, disconnected = remote.metrics("spec_edge_http_in_flight", gone_name)
            samples.append((time.monotonic(), flight, disconnected))  # the time once read: an upper bound
            time.sleep(0.02)

    cancelled_at: list[float] = []

    def on_feedback(feedback) -> bool:
        if not cancelled_at:
            cancelled_at.append(time.monotonic())
            return True
        return False

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result, status = nodes["fb"].stream(on_feedback, **LONG)
        deadline = time.monotonic() + 3.0
        while not any(d == gone + 1 for _, _, d in samples[-1:]) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watching.clear()
        watcher.join(2)
    assert status == "CANCELED" and result.finish_reason == "cancelled", (status, result.finish_reason)
    assert result.text, "cancelled before the first piece"
    freed = [t for t, flight, d in samples if t > cancelled_at[0] and flight == 0 and d == gone + 1]
    assert freed, f"the remote still ran the cancelled request: {samples[-3:]}"
    assert freed[0] - cancelled_at[0] < 1.0, f"the remote freed its slot {freed[0] - cancelled_at[0]:.2f} s after"


def test_server_down_then_back(nodes, tiny_engine, remote):
    """Server stopped: the node with the fallback answers locally within 2 s and says so in its message, the node
    without one answers "remote unavailable" within 1 s (then at once, the circuit open); server started again:
    both are served remotely again within the probe interval (a call sent later than that is not local)."""
    alone = run_one(tiny_engine, engine_request(**ASK))
    text = alone.text.split("\x00")[0]
    remote.stop()
    try:
        out, took = answer(nodes["fb"], **ASK)
        assert out["success"] and out["message"].startswith(LOCAL) and took < 2.0, (took, out)
        assert out["text"] == text
        out, took = answer(nodes["bare"], **ASK)
        assert not out["success"] and took < 1.0, (took, out)
        assert out["message"].startswith(f"remote unavailable: {remote.url}/v1 (APIConnectionError"), out["message"]
        out, took = answer(nodes["bare"], **ASK)
        assert out["message"].startswith(f"remote unavailable: the circuit to {remote.url}/v1 is open") and \
            took < 1.0, (took, out)
        out, took = answer(nodes["fb"], **ASK)
        assert out["message"].startswith(f"{LOCAL}the circuit to {remote.url}/v1 is open") and took < 2.0, (took, out)
    finally:
        remote.start()
    up = time.monotonic()
    for ns, client in nodes.items():
        while True:
            sent = time.monotonic()
            out, _ = answer(client, **ASK)
            if out["success"] and out["message"] == "":
                break
            assert sent - up < PROBE_S + 1.0, f"{ns}: still not served remotely past the probe interval: {out}"
            time.sleep(0.05)
        assert out["text"] == text, ns
