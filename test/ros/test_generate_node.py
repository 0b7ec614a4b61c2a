"""The /generate service and action over real DDS: one node process, client processes, the core as oracle."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rosutil import REPO, engine_request, finish_client, run_client, start_client, test_params
from spec_edge.runtime.serving import front_of
from spec_edge.runtime.scheduler import run_one

pytestmark = pytest.mark.real_model("fp32")

PROMPT = "List three colours of the rainbow."
COPY_PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(test_params())


# the GenerationStats fields that are counts, the same for the same request alone (not times, not the load)
EXACT_STATS = ("drafter", "k", "prompt_tokens", "drafted", "accepted", "forced", "cut", "verify_calls_by_k",
               "policy_off_steps")


def assert_stats_equal_core(stats: dict, num_tokens: int, core_stats) -> None:
    """The node's stats of a request that ran alone are the core's for it: every count equal (a speculating
    request's: it drafted), the rates derived from them, the times set."""
    assert num_tokens > 0
    want = core_stats.as_dict()
    assert {name: stats[name] for name in EXACT_STATS} == {name: want[name] for name in EXACT_STATS}
    assert stats["drafted"] > 0  # the default profile speculates: the comparison covers the accept counts
    assert abs(stats["acceptance_rate"] - want["acceptance_rate"]) < 1e-6
    assert abs(stats["mean_accepted_length"] - want["mean_accepted_length"]) < 1e-6
    assert stats["tokens_per_s"] > 0 and stats["time_to_first_token_s"] > 0


def expected(reference_engine, **fields):
    return run_one(reference_engine, engine_request(**fields))


def test_ask_json_equals_core(server, module_env, reference_engine):
    """`spec-edge ask --json` in a client process: the node's answer is the core's answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "spec_edge.cli", "ask", "--prompt", COPY_PROMPT, "--max-new-tokens", "24", "--json"],
        env=module_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert set(answer) >= {"success", "message", "text", "num_tokens", "finish_reason", "stats"}
    # what answered, as `spec-edge generate --json` names it: the node's runtime.profile and graphs.weights
    assert (answer["profile"], answer["weights"]) == ("smollm2-135m", "fp32")
    want = expected(reference_engine, prompt=COPY_PROMPT, max_new_tokens=24)
    assert answer["success"] is True, answer["message"]
    assert answer["text"] == want.text
    assert answer["num_tokens"] == len(want.token_ids)
    assert answer["token_ids"] == want.token_ids
    assert answer["finish_reason"] == want.finish_reason
    assert_stats_equal_core(answer["stats"], answer["num_tokens"], want.stats)


def test_chat_messages_and_plain_decoding(server, module_env, reference_engine):
    messages = [("system", "You answer in one short sentence."), ("user", "What is a robot?")]
    a, b = run_client(module_env, {"mode": "call", "requests": [
        {"messages": messages, "max_new_tokens": 12},
        {"prompt": PROMPT, "max_new_tokens": 12, "speculate": False}]})
    assert a["success"] and b["success"], (a["message"], b["message"])
    assert a["text"] == expected(reference_engine, messages=messages, max_new_tokens=12).text
    assert b["text"] == expected(reference_engine, prompt=PROMPT, max_new_tokens=12, speculate=False).text
    assert b["stats"]["drafted"] == 0


def test_stop_string(server, module_env, reference_engine):
    full = expected(reference_engine, prompt=COPY_PROMPT, max_new_tokens=24).text
    stop = full.split()[2] if len(full.split()) > 2 else full.strip()[:3]
    answer, = run_client(module_env, {"mode": "call", "requests": [
        {"prompt": COPY_PROMPT, "max_new_tokens": 24, "stop": [stop]}]})
    assert answer["success"], answer["message"]
    assert answer["finish_reason"] == "stop"
    assert stop not in answer["text"]
    assert answer["text"] == expected(reference_engine, prompt=COPY_PROMPT, max_new_tokens=24, stop=[stop]).text


def test_stream_feedback_concatenates_to_result(server, module_env, reference_engine):
    out = run_client(module_env, {"mode": "stream", "request": {"prompt": COPY_PROMPT, "max_new_tokens": 24}})
    assert out["status"] == "SUCCEEDED"
    result = out["result"]
    assert result["success"], result["message"]
    assert len(out["deltas"]) > 1
    assert "".join(out["deltas"]) == result["text"]
    want = expected(reference_engine, prompt=COPY_PROMPT, max_new_tokens=24)
    assert result["text"] == want.text and result["token_ids"] == want.token_ids
    assert out["num_tokens"] == sorted(out["num_tokens"]) and out["num_tokens"][-1] <= result["num_tokens"]
    assert_stats_equal_core(result["stats"], result["num_tokens"], want.stats)


def test_feedback_reaches_a_reader_matched_after_it_was_sent(server, module_env):
    """Discovery is not symmetric: a fresh client can have its goal accepted and answered before the node's
    feedback writer has matched the client's reader. The feedback topic keeps its history for such a reader
    (a subscription made after the goal ended gets the goal's deltas), so no delta is lost in that gap."""
    out = run_client(module_env, {"mode": "stream", "late_reader": True,
                                  "request": {"prompt": PROMPT, "max_new_tokens": 12}})
    assert out["status"] == "SUCCEEDED" and out["result"]["text"]
    assert out["result"]["text"] in out["late"]


def test_stream_cancel_then_next_request_served(server, module_env, reference_engine):
    out = run_client(module_env, {"mode": "stream", "cancel_after": 3,
                                  "request": {"prompt": PROMPT, "max_new_tokens": 200}})
    assert out["status"] == "CANCELED"
    assert out["result"]["finish_reason"] == "cancelled"
    assert out["result"]["num_tokens"] < 200
    answer, = run_client(module_env, {"mode": "call", "requests": [{"prompt": PROMPT, "max_new_tokens": 10}]})
    assert answer["success"], answer["message"]
    assert answer["text"] == expected(reference_engine, prompt=PROMPT, max_new_tokens=10).text


BAD_REQUESTS = [
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("prompt over the context", {"prompt": "robot " * 3000}, "context"),
    ("max_new_tokens 0", {"prompt": PROMPT, "max_new_tokens": 0}, "max_new_tokens"),
    ("max_new_tokens 10^9", {"prompt": PROMPT, "max_new_tokens": 10**9}, "max_new_tokens"),
    ("temperature -1", {"prompt": PROMPT, "temperature": -1.0}, "temperature"),
    ("temperature inf", {"prompt": PROMPT, "temperature": float("inf")}, "temperature"),
    ("temperature nan", {"prompt": PROMPT, "temperature": float("nan")}, "temperature"),
    ("top_p 0", {"prompt": PROMPT, "top_p": 0.0}, "top_p"),
    ("top_p 2", {"prompt": PROMPT, "top_p": 2.0}, "top_p"),
    ("unknown drafter", {"prompt": PROMPT, "drafter": "telepathy"}, "drafter"),
    ("k without a verify graph", {"prompt": PROMPT, "k": 3}, "k"),
    # (U+FFFD is text, also where rclpy made it of bytes that are not UTF-8: test_node_as_found.py)
    ("seed below -1", {"prompt": PROMPT, "seed": -5}, "seed"),
    ("control characters", {"prompt": "hello \x07\x1b[31m world"}, "control"),
    ("unknown role", {"messages": [["robot", "Say hi."]]}, "role 'robot'"),
    ("prompt + max_new_tokens over the context", {"prompt": PROMPT, "max_new_tokens": 1020}, "exceed the context"),
]


def test_bad_requests_refused_and_node_keeps_serving(server, module_env, reference_engine):
    requests = [fields for _, fields, _ in BAD_REQUESTS] + [{"prompt": PROMPT, "max_new_tokens": 10}]
    answers = run_client(module_env, {"mode": "call", "requests": requests})
    for (what, _, hint), answer in zip(BAD_REQUESTS, answers):
        assert answer["success"] is False, f"{what}: accepted: {answer}"
        assert answer["message"], f"{what}: no message"
        assert hint.lower() in answer["message"].lower(), f"{what}: message does not name '{hint}': {answer['message']}"
        assert answer["text"] == ""
    good = answers[-1]
    assert good["success"], good["message"]
    assert good["text"] == expected(reference_engine, prompt=PROMPT, max_new_tokens=10).text


@pytest.mark.parametrize("field,value", [("top_p", 2.0), ("temperature", float("inf"))])
def test_bad_goal_refused_through_action(server, module_env, field, value):
    out = run_client(module_env, {"mode": "stream", "request": {"prompt": PROMPT, field: value}})
    assert out["status"] == "ABORTED"
    assert out["result"]["success"] is False and field in out["result"]["message"]


def test_diagnostics(server, module_env):
    statuses = run_client(module_env, {"mode": "diagnostics"})
    assert statuses, "no DiagnosticArray on /diagnostics"
    values = statuses[0]["values"]
    for key in ("backend", "memory_bytes", "queue_depth", "last_acceptance_rate", "last_tokens_per_s"):
        assert key in values, f"/diagnostics lacks {key}: {sorted(values)}"
    assert statuses[0]["message"] in ("ready", "queue full")
    # memory_bytes: the RSS now (it can go down again); the peak is its own value
    assert 0 < int(values["memory_bytes"]) <= int(values["memory_peak_bytes"])


def test_tokenize_service(server, module_env, reference_engine):
    from spec_edge.runtime.requests import GenerateRequest
    text = "Which way is the kitchen?"
    raw = reference_engine.tokenizer.encode(text)
    chat = front_of(reference_engine).prompt_ids(GenerateRequest(prompt=text))
    vocab = reference_engine.target.vocab_size
    answers = run_client(module_env, {"mode": "tokenize", "requests": [
        {"text": text}, {"text": text, "chat": True}, {"ids": raw},
        {"text": text, "ids": raw}, {}, {"ids": [1, vocab]}]})
    assert [a["success"] for a in answers] == [True, True, True, False, False, False], answers
    assert answers[0]["ids"] == raw and len(chat) > len(raw) and answers[1]["ids"] == chat
    assert answers[2]["text"] == text
    assert "not both" in answers[3]["message"] and "not both" in answers[4]["message"]
    assert f"[{vocab}]" in answers[5]["message"] and "outside the vocabulary" in answers[5]["message"]


@pytest.mark.release
def test_load_eight_clients(server, module_env, reference_engine):
    """8 client processes x 3 requests at once: none lost or duplicated, each = its answer alone (the core's,
    in this process: the node's batch rows are computed as when each request is alone)."""
    per_client = [[{"prompt": f"Client {c}, request {r}: name a fruit that starts with {'ABCDEFGH'[c]}.",
                    "max_new_tokens": 6} for r in range(3)] for c in range(8)]
    procs = [start_client(module_env, {"mode": "call", "requests": reqs}) for reqs in per_client]
    together = [finish_client(p) for p in procs]
    for c, answers in enumerate(together):
        assert len(answers) == 3
        for r, answer in enumerate(answers):
            want = expected(reference_engine, **per_client[c][r])
            # at most 8 requests are ever outstanding: 1 runs, <= 7 wait < serve.queue_limit=8
            assert answer["success"], f"client {c} request {r}: {answer['message']}"
            assert answer["text"] == want.text, f"client {c} request {r}"
            assert answer["num_tokens"] == len(want.token_ids)


def test_busy_only_past_the_queue_limit(server, module_env):
    limit = 8  # serve.queue_limit of the test profile (the default)
    requests = [{"prompt": f"{PROMPT} ({i})", "max_new_tokens": 24} for i in range(limit + 4)]
    answers = run_client(module_env, {"mode": "burst", "requests": requests + [{"prompt": "  "}]})
    assert all(a is not None for a in answers), "a request got no answer"
    # a bad request sent into the full queue is refused for what is wrong with it, not as busy
    bad = answers.pop()
    assert not bad["success"] and "prompt is empty" in bad["message"], bad
    busy = [a for a in answers if not a["success"]]
    served = [a for a in answers if a["success"]]
    assert all(a["message"].startswith("busy") and "queue_limit" in a["message"] for a in busy), busy
    assert len(served) >= limit + 1, f"only {len(served)} served: busy before the queue was full"
    assert 1 <= len(busy) <= 3, f"{len(busy)} busy of {len(answers)}"


ALARM = json.dumps({"type": "object", "additionalProperties": False, "required": ["severity", "subsystem"],
                    "properties": {"severity": {"enum": ["info", "warning", "critical"]},
                                   "subsystem": {"enum": ["battery", "motor", "lidar", "camera"]}}})
ALARM_PROMPT = "Classify this alarm as JSON: motor 2 temperature 95 C, rising."


def test_guided_json_schema_service_and_action(server, module_env, reference_engine):
    """A JSON Schema through the service and the action: the answer parses, equals the core's; a bad
    schema or two guides at once are refused with the parser's message, and the node keeps serving."""
    guided = {"prompt": ALARM_PROMPT, "max_new_tokens": 40, "json_schema": ALARM}
    answers = run_client(module_env, {"mode": "call", "requests": [
        {"prompt": ALARM_PROMPT, "json_schema": '{"type": "frob"}'},
        {"prompt": ALARM_PROMPT, "json_schema": ALARM, "regex": "a+"},
        guided, {"prompt": PROMPT, "max_new_tokens": 10}]})
    bad, both, good, plain = answers
    assert bad["success"] is False and "json_schema is invalid: Invalid type: frob" in bad["message"]
    assert both["success"] is False and "at most one of json_schema, grammar, regex" in both["message"]
    want = expected(reference_engine, **guided)
    assert good["success"] and good["finish_reason"] == "eos" == want.finish_reason, good
    assert good["text"] == want.text and json.loads(good["text"])["severity"] in ("info", "warning", "critical")
    assert good["stats"]["forced"] == want.stats.forced > 0  # the schema's keys were free drafts
    assert plain["success"] and plain["text"] == expected(reference_engine, prompt=PROMPT, max_new_tokens=10).text
    out = run_client(module_env, {"mode": "stream", "request": guided})
    assert out["status"] == "SUCCEEDED" and out["result"]["text"] == want.text
    out = run_client(module_env, {"mode": "stream", "request": {"prompt": ALARM_PROMPT, "regex": "a(b"}})
    assert out["status"] == "ABORTED" and "regex is invalid" in out["result"]["message"]


def test_distribution_fields_service_and_action(server, module_env, reference_engine):
    """Penalties, logit_bias, min_p, ignore_eos and logprobs through the service and the action: the node's
    answer is the core's (token for token, logprobs allclose); a bad value is refused naming the field."""
    fields = {"prompt": COPY_PROMPT, "max_new_tokens": 16, "repetition_penalty": 1.3, "presence_penalty": 0.2,
              "frequency_penalty": 0.2, "min_p": 0.05, "logit_bias": [[13, -100.0], [28, 1.0]],
              "ignore_eos": True, "logprobs": 3}
    want = expected(reference_engine, **dict(fields, logit_bias=((13, -100.0), (28, 1.0))))
    assert want.finish_reason == "length" and len(want.logprobs) == 16
    answers = run_client(module_env, {"mode": "call", "requests": [
        fields, {"prompt": PROMPT, "logprobs": 21}, {"prompt": PROMPT, "logit_bias": [[10 ** 8, 1.0]]}]})
    good, many, outside = answers
    stream = run_client(module_env, {"mode": "stream", "request": fields})
    assert stream["status"] == "SUCCEEDED"
    for answer in (good, stream["result"]):
        assert answer["success"], answer["message"]
        assert (answer["token_ids"], answer["finish_reason"]) == (want.token_ids, "length")
        assert [e["token_id"] for e in answer["logprobs"]] == want.token_ids
        for got, entry in zip(answer["logprobs"], want.logprobs):
            assert got["top_ids"] == list(entry.top_ids)
            assert abs(got["logprob"] - entry.logprob) < 1e-4
            assert max(abs(a - b) for a, b in zip(got["top_logprobs"], entry.top_logprobs)) < 1e-4
    assert not many["success"] and "logprobs must be in [0, 20]" in many["message"]
    proc = subprocess.run(  # `spec-edge ask` with the same fields as flags
        [sys.executable, "-m", "spec_edge.cli", "ask", "--prompt", COPY_PROMPT, "--max-new-tokens", "16",
         "--repetition-penalty", "1.3", "--presence-penalty", "0.2", "--frequency-penalty", "0.2", "--min-p", "0.05",
         "--logit-bias", "13:-100", "--logit-bias", "28:1", "--ignore-eos", "--logprobs", "3", "--json"],
        env=module_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    asked = json.loads(proc.stdout)
    assert asked["token_ids"] == want.token_ids and [e["top_ids"] for e in asked["logprobs"]] == \
        [list(e.top_ids) for e in want.logprobs]
    assert not outside["success"] and "outside the vocabulary" in outside["message"]
    assert "logprobs" not in run_client(module_env, {"mode": "call", "requests": [
        {"prompt": PROMPT, "max_new_tokens": 2}]})[0]
