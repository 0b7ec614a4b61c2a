"""Tool calls through the ROS door: one node process, client processes, the core (its front) as oracle. With
tool_choice required the embedded default's answer is a call that parses and is valid against the tool's schema
(the node constrains it); the client helper (GenerateClient.run_tools, examples/agent_ros.py) runs call -> tool
result -> answer; refusals carry the front's words. Whether the model picks the right tool is its quality, not
the contract: only validity is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rosutil import REPO, engine_request, run_client, test_params

pytestmark = pytest.mark.real_model("fp32")

sys.path.insert(0, str(REPO / "examples"))
from robot_tools import ROOMS, SYSTEM_PROMPT, TOOLS  # noqa: E402

from spec_edge.runtime.serving import front_of
from spec_edge.runtime.scheduler import run_one  # noqa: E402
from spec_edge.tools.schema_check import violations  # noqa: E402

TOOL_FIELDS = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in TOOLS]
SCHEMAS = {t.name: json.loads(t.parameters) for t in TOOLS}
INSTRUCTIONS = ("Go to the kitchen.", "Pick up the red cup.", "Say hello to the guest.",
                "Bring me the book from the bedroom.", "Tell everyone dinner is ready.")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(test_params())


def robot_request(instruction: str, **fields) -> dict:
    base = dict(messages=[["system", SYSTEM_PROMPT], ["user", instruction]], tools=TOOL_FIELDS, max_new_tokens=96)
    return dict(base, **fields)


def assert_valid_calls(answer: dict, finish_reasons: tuple[str, ...] = ("tool_calls",)) -> list[dict]:
    assert answer["success"], answer["message"]
    assert answer["finish_reason"] in finish_reasons, answer
    calls = answer["tool_calls"]
    assert calls, answer
    assert len({c["id"] for c in calls}) == len(calls), calls
    for call in calls:
        assert call["name"] in SCHEMAS, call
        assert violations(json.loads(call["arguments"]), SCHEMAS[call["name"]]) == [], call
    return calls


def test_required_calls_parse_and_validate(server, module_env, reference_engine):
    """One call for every instruction (parallel_tool_calls false: a robot acts one step at a time), valid against
    its tool's schema; the first equals the core's answer (names and arguments: ids are made per request); a
    tool's name gives calls of that tool. With parallel calls the 135M model tends to go on calling (every room
    in turn) until max_new_tokens: the calls it completed still parse and validate."""
    requests = [robot_request(text, tool_choice="required", parallel_tool_calls=False) for text in INSTRUCTIONS]
    requests.append(robot_request(INSTRUCTIONS[0], tool_choice="move_to", parallel_tool_calls=False))
    requests.append(robot_request(INSTRUCTIONS[0], tool_choice="required"))
    answers = run_client(module_env, {"mode": "call", "requests": requests})
    for answer in answers[:-1]:
        assert len(assert_valid_calls(answer)) == 1
    assert json.loads(answers[-2]["tool_calls"][0]["arguments"])["place"] in ROOMS
    assert answers[-2]["tool_calls"][0]["name"] == "move_to"
    assert_valid_calls(answers[-1], ("tool_calls", "length"))
    want = run_one(reference_engine, engine_request(**requests[0]))
    assert [(c["name"], c["arguments"]) for c in answers[0]["tool_calls"]] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    assert answers[0]["text"] == want.text and answers[0]["token_ids"] == want.token_ids


def test_none_answers_without_calls(server, module_env):
    answer, = run_client(module_env, {"mode": "call", "requests": [robot_request(INSTRUCTIONS[0], tool_choice="none",
                                                                                 max_new_tokens=32)]})
    assert answer["success"], answer["message"]
    assert answer["tool_calls"] == [] and answer["finish_reason"] != "tool_calls"
    assert "<tool_call>" not in answer["text"]


def test_action_result_carries_the_calls(server, module_env):
    """The action's result has the calls; its feedback never shows call markup (it adds up to the text)."""
    out = run_client(module_env, {"mode": "stream", "request": robot_request(INSTRUCTIONS[1], tool_choice="required",
                                                                             parallel_tool_calls=False)})
    assert out["status"] == "SUCCEEDED"
    assert_valid_calls(out["result"])
    assert "".join(out["deltas"]) == out["result"]["text"]


def test_agent_loop_over_the_service(server, module_env):
    """examples/agent_ros.py (GenerateClient.run_tools): a call, the tool's result sent back with the call's id, then
    a text answer."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "agent_ros.py"), "Go to the kitchen and say hi.",
                           "--tool-choice", "required", "--max-turns", "2", "--json"],
                          env=module_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["calls"] and out["turns"] == 2
    assert [(c["name"], json.loads(c["arguments"])) for c in out["calls"]] == [tuple(entry) for entry in out["log"]]
    for call in out["calls"]:
        assert violations(json.loads(call["arguments"]), SCHEMAS[call["name"]]) == []
        assert call["result"]
    assert out["answer"].strip() and out["finish_reason"] != "tool_calls"
    assert "<tool_call>" not in out["answer"]


def test_ask_with_tools(server, module_env):
    """`spec-edge ask --tools FILE --tool-choice required --json`: the calls are the JSON's tool_calls."""
    proc = subprocess.run([sys.executable, "-m", "spec_edge.cli", "ask", "--prompt", INSTRUCTIONS[0], "--tools",
                           str(REPO / "bench" / "robot_tools.json"), "--tool-choice", "required",
                           "--no-parallel-tool-calls", "--max-new-tokens", "96", "--json"],
                          env=module_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(assert_valid_calls(json.loads(proc.stdout))) == 1


def refusal_cases() -> list:
    say = TOOL_FIELDS[2]
    return [
        ("duplicate tool names", {"tools": [say, say]}),
        ("tool_choice naming no tool", {"tool_choice": "fly"}),
        ("invalid JSON Schema", {"tools": [dict(say, parameters='{"type": "object", "properties": 7}')]}),
        ("tools with guided", {"json_schema": '{"type": "object"}'}),
        ("tools with ignore_eos", {"ignore_eos": True}),
        ("schema not JSON", {"tools": [dict(say, parameters="{not json")]}),  # last: it once killed the node
    ]


def test_refusals_carry_the_fronts_words(server, module_env, reference_engine):
    from spec_edge.runtime.requests import RequestError
    requests = [dict(robot_request(INSTRUCTIONS[0], max_new_tokens=8), **fields) for _, fields in refusal_cases()]
    answers = run_client(module_env, {"mode": "call", "requests": requests}, timeout=120)  # answered at once
    for (what, _), request, answer in zip(refusal_cases(), requests, answers):
        with pytest.raises(RequestError) as refused:
            front_of(reference_engine).prepare(engine_request(**request))
        assert answer["success"] is False and answer["finish_reason"] == "", f"{what}: {answer}"
        assert answer["message"] == str(refused.value), what
