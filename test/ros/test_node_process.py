"""The node as a process: request timeout, SIGTERM during a generation (the launch file: test_launch_file.py)."""
from __future__ import annotations

import signal
import sys
import time

import pytest

from rosutil import (DDS_LEASE_S, IDLE_EXIT_S, REPO, Server, exit_limit, finish_client, run_client, start_client,
                     test_params, write_params)

pytestmark = pytest.mark.real_model("fp32")

PROMPT = "Write a long story about a robot that learns to paint."


@pytest.fixture(scope="module")
def short_timeout_server(server_factory):
    return server_factory(test_params(**{"serve.request_timeout_s": 3.0}), name="short_timeout")


@pytest.fixture(scope="module")
def idle_exit_s(server_factory) -> float:
    """The seconds an idle node takes to exit after SIGINT, measured here (under whatever load this run has): the
    baseline of the bounds on exits while the node works (rosutil.exit_limit)."""
    server = server_factory(test_params(), name="sigint")
    took = server.stop(signal.SIGINT)
    assert server.proc.returncode == 0, server.log()[-2000:]
    return took


def test_request_past_its_timeout_ends_with_error(short_timeout_server, module_env):
    started = time.monotonic()
    # 960 tokens whatever the text (ignore_eos), one target step each (drafter none: a looping text after an
    # ignored eos is drafted almost whole, which let a fast CI machine finish inside the timeout): 320 tok/s of
    # plain fp32 decoding would be needed to beat the 3 s timeout
    late, = run_client(module_env, {"mode": "call", "requests": [{"prompt": PROMPT, "max_new_tokens": 960,
                                                                   "ignore_eos": True, "drafter": "none"}]})
    assert time.monotonic() - started < 60
    assert late["success"] is False, late
    assert late["finish_reason"] == "error", late
    assert "timed out" in late["message"] and "request_timeout_s" in late["message"]
    quick, = run_client(module_env, {"mode": "call", "requests": [{"prompt": PROMPT, "max_new_tokens": 2}]})
    assert quick["success"], quick["message"]


def test_sigterm_during_generation_exits_promptly(short_timeout_server, module_env, idle_exit_s):
    server = short_timeout_server
    client = start_client(module_env, {"mode": "stream", "request": {"prompt": PROMPT, "max_new_tokens": 900}})
    for line in client.stderr:  # the client reports its first feedback: the node is generating
        if "first_feedback" in line:
            break
    limit = exit_limit(idle_exit_s)
    took = server.stop(signal.SIGTERM, timeout=limit + IDLE_EXIT_S)
    assert server.proc.returncode == 0, server.log()[-2000:]
    assert took < limit, f"exit took {took:.2f} s (idle: {idle_exit_s:.2f} s)"
    out = finish_client(client, timeout=30)  # the goal ends with the node, it is not left hanging
    assert out["status"] == "ABORTED" and out["result"]["finish_reason"] == "cancelled", out
    assert "shut down" in out["result"]["message"]
    assert "shutting down" in server.log()


def test_sigint_exits(idle_exit_s):
    assert idle_exit_s < IDLE_EXIT_S, f"exit took {idle_exit_s:.2f} s"


def test_exit_leaves_the_ros_graph_at_once(server_factory, module_env, idle_exit_s):
    """Other nodes see the node gone at once (not after a DDS lease of 15-20 s: half of it is the bound)."""
    server = server_factory(test_params(), name="graph")
    watcher = start_client(module_env, {"mode": "graph", "node": "spec_edge"})
    for line in watcher.stderr:
        if "seen" in line:
            break
    signalled = time.time()
    took = server.stop(signal.SIGTERM)
    assert server.proc.returncode == 0 and took < IDLE_EXIT_S, (took, server.log()[-2000:])
    gone = finish_client(watcher, timeout=60)["gone_at"] - signalled
    assert gone < DDS_LEASE_S / 2, f"still in the graph {gone:.1f} s after SIGTERM (exit took {took:.2f} s)"


def test_lifecycle_loads_on_configure_and_frees_on_cleanup(module_env, tmp_path):
    """--no-autostart: a lifecycle manager (here a client process) drives configure/activate/cleanup."""
    params = write_params(tmp_path / "lifecycle.yaml", test_params())
    server = Server(module_env, params, tmp_path / "lifecycle.log", argv=[
        sys.executable, "-m", "spec_edge.ros2.node", "--no-autostart", "--ros-args", "--params-file", str(params)])
    server.start(ready="waiting for a lifecycle manager")
    try:
        assert "engine loaded" not in server.log()
        out = run_client(module_env, {
            "mode": "lifecycle", "node": "/spec_edge", "request": {"prompt": PROMPT, "max_new_tokens": 4},
            "transitions": ["configure", "activate", "deactivate", "cleanup"]})
        assert out["configure"] and out["activate"] and out["deactivate"] and out["cleanup"], out
        assert out["served"]["success"], out["served"]["message"]
        assert out["after"]["success"] is False and "not active" in out["after"]["message"], out["after"]
        log = server.log()
        assert log.index("engine loaded") < log.index("engine freed")
    finally:
        server.stop()


@pytest.mark.release
def test_signal_during_first_start_export_exits_promptly(module_env, tmp_path, idle_exit_s):
    """A first start exports the graphs for minutes inside configure; a signal must still end it at once,
    and what it was writing must not be taken for a finished export. SIGINT (what ros2 launch sends
    first); SIGTERM goes to the same handler (ros2/node.py run), tested while generating above."""
    engines = tmp_path / "engines"
    params = write_params(tmp_path / "fresh.yaml", test_params(**{"runtime.engine_dir": str(engines)}))
    server = Server(module_env, params, tmp_path / "fresh.log", argv=[
        sys.executable, "-m", "spec_edge.ros2.node", "--ros-args", "--params-file", str(params)])
    server.start(ready="[export] target: graph 1/")  # exporting, well past the model load
    limit = exit_limit(idle_exit_s)
    took = server.stop(signal.SIGINT, timeout=limit + IDLE_EXIT_S)
    assert server.proc.returncode == 0, server.log()[-2000:]
    assert took < limit, f"exit took {took:.2f} s (idle: {idle_exit_s:.2f} s):\n{server.log()[-2000:]}"
    assert "stopped while configuring" in server.log()
    assert "it/s]" not in server.log()  # no tqdm bars (redrawn with \r) in a log that is not a terminal
    assert not list((engines / "smollm2-135m" / "onnx").glob("[!.]*"))  # only the temporary folder


def test_unknown_parameter_is_refused_like_serve_refuses_it(module_env, tmp_path):
    """A typo in a launch params file must not be ignored: the node refuses it with serve's message."""
    import subprocess

    params = tmp_path / "typo.yaml"
    params.write_text("/**:\n  ros__parameters:\n    speculative:\n      drafterr: none\n")
    serve = subprocess.run([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(params)],
                           env=module_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2
    message = serve.stderr.strip().split(": ", 2)[-1]  # "spec-edge serve: <file>: <message>"
    assert message.startswith("unknown config keys ['speculative.drafterr']"), serve.stderr
    server = Server(module_env, params, tmp_path / "typo.log", argv=[
        sys.executable, "-m", "spec_edge.ros2.node", "--ros-args", "--params-file", str(params)])
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start(timeout=120)
    assert f"configure: {message}" in server.log()


def test_sigint_after_a_lifecycle_shutdown_exits_quietly_within_2s(server_factory, module_env):
    """`ros2 lifecycle set /spec_edge shutdown`, then Ctrl-C: the finalized node is not shut down a second time
    (rclpy raised "Shutdown transtion not possible", logged as a warning), and exits within 2 s."""
    server = server_factory(test_params(), name="finalized")
    out = run_client(module_env, {"mode": "lifecycle", "node": "/spec_edge", "transitions": ["shutdown_active"],
                                  "request": {"prompt": PROMPT, "max_new_tokens": 2}})
    assert out["shutdown_active"] and out["after"]["success"] is False, out
    took = server.stop(signal.SIGINT)
    assert server.proc.returncode == 0 and took < 2.0, (took, server.log()[-2000:])
    assert "transtion" not in server.log() and "lifecycle shutdown" not in server.log(), server.log()[-2000:]
