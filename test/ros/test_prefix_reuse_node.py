"""Prefix reuse through the node (real rclpy, DDS on loopback): serve.warm_system_prompt prefills the
configured system prompt at start; requests with it, and a repeated one, answer exactly what a cold
engine answers."""
from __future__ import annotations

import pytest

from rosutil import engine_request, run_client, test_params
from spec_edge.runtime.scheduler import run_one

pytestmark = pytest.mark.real_model("fp32")

SYSTEM = ("You control RB-7, a mobile robot with an arm and a gripper. Tools: move_base(x, y), move_arm(x, y, z), "
          "read_battery(), dock(). Answer briefly.")
PARAMS = test_params(**{"serve.system_prompt": SYSTEM, "serve.warm_system_prompt": True})


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(PARAMS)


@pytest.fixture(scope="module")
def cold_engine():
    from spec_edge import config as cfgmod
    from spec_edge import artifacts
    engine = artifacts.engine(cfgmod.from_params({**PARAMS, "serve.reuse_prefix": False,
                                                    "serve.warm_system_prompt": False}))
    yield engine
    engine.close()


def test_warm_system_prompt_and_reused_requests_equal_cold(server, module_env, cold_engine):
    assert "warmed the cache with the system prompt" in server.log()
    requests = [{"prompt": "Which tool checks the battery?", "max_new_tokens": 16},
                {"prompt": "Drive to the dock.", "max_new_tokens": 16},
                {"prompt": "Drive to the dock.", "max_new_tokens": 16}]
    answers = run_client(module_env, {"mode": "call", "requests": requests})
    for request, answer in zip(requests, answers):
        assert answer["success"], answer["message"]
        want = run_one(cold_engine, engine_request(**request))
        assert want.stats.prompt_tokens_reused == 0
        assert answer["text"] == want.text and answer["num_tokens"] == len(want.token_ids)
    # every request reused the warmed system prompt's rows; the repeated one all of its prompt but the last token
    reused = [answer["stats"]["prompt_tokens_reused"] for answer in answers]
    assert reused[0] > 0 and reused[1] == reused[0], reused
    assert reused[2] == answers[2]["stats"]["prompt_tokens"] - 1, reused
