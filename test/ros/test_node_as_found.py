"""The node as a robot team finds it (issue 34), one default-profile node (q4, 4 slots) with room for 16:
text ends on a whole character, U+FFFD is text, --json is strict JSON, the capacity is slots + queue_limit,
a client cannot hang and 16 fresh client processes streaming at once are all answered, /diagnostics tells
memory by kind, and the shutdown transition frees the engine (last: it finalizes the node)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time

import pytest

from rosutil import REPO, finish_client, run_client, start_client, test_params

pytestmark = pytest.mark.real_model("fp32", "default")

SLOTS, QUEUE = 4, 12
CUT_PROMPT = "Café au lait? — 你好 🤖"  # its greedy answer is emoji: 8 tokens end inside the third one
SCHEMA = '{"type":"object","properties":{"room":{"type":"string"}},"required":["room"]}'


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (Python's default parser takes them; strict parsers do not)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(test_params(**{
        "graphs.weights": "q4", "graphs.batch_slots": SLOTS, "runtime.profile": "smollm2-135m",
        "speculative.drafter": "ngram", "speculative.k": 4, "serve.queue_limit": QUEUE}))


@pytest.fixture(scope="module")
def tokenizer(server):
    from spec_edge import config as cfgmod
    from spec_edge.graphs import plan
    from spec_edge.runtime.tokenizer import Tokenizer
    return Tokenizer(plan.artifact_dir(cfgmod.from_params(test_params()), "target"))


def run(args: list[str], env: dict, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spec_edge.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_answer_cut_inside_a_character_ends_on_a_whole_one(server, module_env, tokenizer):
    """D1: the service's text and the action's deltas never carry half a character; the ids keep it."""
    request = {"prompt": CUT_PROMPT, "max_new_tokens": 8}
    called, = run_client(module_env, {"mode": "call", "requests": [request]})
    streamed = run_client(module_env, {"mode": "stream", "request": request})
    for answer in (called, streamed["result"]):
        assert answer["success"] and answer["finish_reason"] == "length" and answer["num_tokens"] == 8, answer
        full = tokenizer.decode(answer["token_ids"])
        assert full.endswith("\ufffd"), full  # the case at hand: the 8th token ends inside a character
        assert answer["text"] == full[:-1] and "\ufffd" not in answer["text"]
    assert not any("\ufffd" in delta for delta in streamed["deltas"]), streamed["deltas"]
    assert "".join(streamed["deltas"]) == streamed["result"]["text"]


def test_replacement_character_is_text_and_the_node_takes_its_own_output_back(server, module_env):
    """D2: U+FFFD in a prompt and in an assistant turn (the node's answer as an older node gave it) is served;
    a seed below -1 is refused."""
    turns = [["user", CUT_PROMPT], ["assistant", "\U0001f31f\U0001f31f\ufffd"], ["user", "Again, in words."]]
    plain, chat, seed = run_client(module_env, {"mode": "call", "requests": [
        {"prompt": "ok \ufffd", "max_new_tokens": 4}, {"messages": turns, "max_new_tokens": 4},
        {"prompt": "ok", "seed": -5}]})
    assert plain["success"] and plain["num_tokens"] == 4, plain["message"]
    assert chat["success"] and chat["num_tokens"] == 4, chat["message"]
    assert not seed["success"] and "seed must be >= 0" in seed["message"] and "got -5" in seed["message"]


def test_json_outputs_are_strict_json(server, module_env):
    """D4: `ask --json` (service and action) and `generate --json` with logprobs and a guide parse with a strict
    parser; a forbidden token is never listed, so the top-N may list fewer than N; a refusal exits 2 in both."""
    guided = ["--prompt", "Which room is the printer in?", "--json", "--logprobs", "2", "--json-schema", SCHEMA,
              "--max-new-tokens", "24"]
    outputs = {"ask": run(["ask", *guided], module_env), "ask --stream": run(["ask", "--stream", *guided], module_env),
               "generate": run(["generate", *guided, "--config", str(REPO / "config" / "default.yaml"),
                                "--engine-dir", str(REPO / "engines")], module_env)}
    fewer = False
    for name, proc in outputs.items():
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        answer = strict_json(proc.stdout)
        assert answer["logprobs"] and len(answer["logprobs"]) == len(answer["token_ids"]), name
        for entry in answer["logprobs"]:
            assert math.isfinite(entry["logprob"]) and entry["top_ids"][0] == entry["token_id"]  # greedy
            assert 1 <= len(entry["top_ids"]) == len(entry["top_logprobs"]) <= 2
            assert all(math.isfinite(v) for v in entry["top_logprobs"])
            fewer |= len(entry["top_ids"]) < 2
    assert fewer  # the schema forces some tokens ('{"room": "'): their rows allow one id only
    for command in (["ask", "--prompt", "hi", "--seed", "-5", "--json"],
                    ["generate", "--prompt", "hi", "--seed", "-5", "--json", "--config",
                     str(REPO / "config" / "default.yaml"), "--engine-dir", str(REPO / "engines")]):
        proc = run(command, module_env)
        assert proc.returncode == 2 and "seed must be >= 0" in proc.stdout + proc.stderr, (command, proc.stderr)


def test_diagnostics_tell_memory_by_kind(server, module_env):
    """D8: RSS, Pss, private anonymous and file-backed memory, each its own value."""
    status, = run_client(module_env, {"mode": "diagnostics"})
    values = {k: int(v) for k, v in status["values"].items() if k.startswith("memory_")}
    assert values["memory_anon_bytes"] > 0 and values["memory_file_bytes"] > 0, values
    assert values["memory_pss_bytes"] <= values["memory_bytes"], values
    assert values["memory_anon_bytes"] + values["memory_file_bytes"] <= values["memory_bytes"] * 1.01, values


def test_capacity_is_slots_plus_queue(server, module_env):
    """D3: a burst of slots + queue_limit + 1 to an idle node: slots + queue_limit are served in full, exactly
    one is busy (test_worker.py holds a burst of exactly capacity and one more to the same, without DDS)."""
    # long enough (ignore_eos: each runs 24 tokens) that none ends before the whole burst has arrived
    request = {"prompt": "Count the robots.", "max_new_tokens": 24, "ignore_eos": True}
    answers = run_client(module_env, {"mode": "burst", "requests": [request] * (SLOTS + QUEUE + 1)})
    refused = [a for a in answers if not a["success"]]
    assert len(refused) == 1 and refused[0]["message"].startswith("busy:"), [a["message"] for a in refused]
    assert sum(a["success"] and a["num_tokens"] == 24 for a in answers) == SLOTS + QUEUE


@pytest.mark.release
def test_sixteen_fresh_client_processes_streaming_at_once(server, module_env):
    """D5: 16 client processes started together, each waits for the action itself and streams; all answered."""
    clients = [start_client(module_env, {"mode": "stream", "wait": 120, "request": {
        "prompt": f"Name robot number {i}.", "max_new_tokens": 6}}) for i in range(16)]
    answers = [finish_client(c, timeout=300) for c in clients]
    for answer in answers:
        assert answer["status"] == "SUCCEEDED" and answer["result"]["success"], answer["result"]["message"]
        assert "".join(answer["deltas"]) == answer["result"]["text"]


def test_documented_client_example_runs_as_written(server, module_env):
    """D5: the usage example in spec_edge/ros2/client.py's docstring, run as it is written."""
    from spec_edge.ros2 import client
    doc = client.__doc__
    example = textwrap.dedent(doc[doc.index("\n\n") + 2:doc.index("\nNo call can hang")])
    assert "client.call(" in example and "client.stream(" in example
    proc = subprocess.run([sys.executable, "-c", example], env=module_env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SUCCEEDED: " in proc.stdout, proc.stdout


def test_documented_rclpy_example_runs_as_written(server, module_env):
    """D5: docs/ros.md's plain rclpy example (another node calling /generate), run as it is written."""
    doc = (REPO / "docs" / "ros.md").read_text()
    block = doc[doc.index("From another node (rclpy"):]
    example = block[block.index("```python\n") + len("```python\n"):block.index("\n```\n")]
    proc = subprocess.run([sys.executable, "-c", example], env=module_env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tok/s, " in proc.stdout, proc.stdout


def test_client_without_a_node_raises_instead_of_hanging(module_env):
    """D5: every call waits for readiness with a timeout and says what to check."""
    code = textwrap.dedent("""
        import time, rclpy
        from spec_edge.ros2.client import GenerateClient
        rclpy.init()
        with GenerateClient(namespace="nobody_here", wait_timeout=2.0) as client:
            for call in (lambda: client.call(prompt="hi"), lambda: client.stream(prompt="hi")):
                started = time.monotonic()
                try:
                    call()
                except TimeoutError as err:
                    print(f"{time.monotonic() - started:.1f} {err}")
        rclpy.shutdown()
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=module_env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr[-2000:]
    for line, what in zip(lines, ("service /nobody_here/generate", "action /nobody_here/generate")):
        took, message = line.split(" ", 1)
        assert float(took) < 10 and message.startswith(what) and "did not appear within 2.0 s" in message, line


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_shutdown_frees_the_engine_as_cleanup_does(server, module_env):
    """D6 (last: the node is finalized after it): memory after the shutdown transition is within 10 % of
    memory after cleanup, and a request to the finalized node hears that it is shutting down."""
    request = {"prompt": "hello", "max_new_tokens": 4}
    cleaned = run_client(module_env, {"mode": "lifecycle", "node": "/spec_edge", "request": request,
                                      "transitions": ["deactivate", "cleanup"]})
    assert cleaned["cleanup"], cleaned
    time.sleep(1.0)
    after_cleanup = rss(server.proc.pid)
    shut = run_client(module_env, {"mode": "lifecycle", "node": "/spec_edge", "request": request,
                                   "transitions": ["configure", "activate", "shutdown_active"]})
    assert shut["served"]["success"] and shut["shutdown_active"], shut
    time.sleep(1.0)
    after_shutdown = rss(server.proc.pid)
    assert after_shutdown <= 1.10 * after_cleanup, (after_cleanup / 1e6, after_shutdown / 1e6)
    assert not shut["after"]["success"] and shut["after"]["message"].startswith("the node is shutting down"), shut
