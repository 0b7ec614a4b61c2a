"""The node's parameters through ROS's own parameter services: each name described as itself, typed
(an empty list too), described, and refused while the node is configured (they apply at configure)."""
from __future__ import annotations

import sys

import pytest

from rosutil import Server, run_client, test_params, write_params

pytestmark = pytest.mark.real_model("fp32")

NAMES = ["serve.speculate_k_by_load", "model.draft", "memory.os_ros_reserve_gb", "graphs.max_context",
         "speculative.forced_drafts", "graphs.k_values"]


@pytest.fixture(scope="module")
def server(module_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("params")
    # a params file writing a double as an integer (request_timeout_s: 60) is taken as 60.0
    params = write_params(tmp / "params.yaml", test_params(**{"serve.request_timeout_s": 60}))
    server = Server(module_env, params, tmp / "params.log", argv=[
        sys.executable, "-m", "spec_edge.ros2.node", "--ros-args", "--params-file", str(params)])
    server.start()
    yield server
    server.stop()


def test_describe_answers_each_name_with_its_own_type_and_description(server, module_env):
    from rcl_interfaces.msg import ParameterType as T
    out = run_client(module_env, {"mode": "params", "node": "/spec_edge", "describe": NAMES})
    described = out["describe"]
    assert [d["name"] for d in described] == NAMES
    assert [d["type"] for d in described] == [T.PARAMETER_INTEGER_ARRAY, T.PARAMETER_STRING, T.PARAMETER_DOUBLE,
                                              T.PARAMETER_INTEGER, T.PARAMETER_BOOL, T.PARAMETER_INTEGER_ARRAY]
    # the comments beside the field in spec_edge/config.py
    assert "the load policy" in described[0]["description"]
    assert "draft model for speculative.drafter=draft" in described[1]["description"]
    assert "prompt + generated tokens must fit" in described[3]["description"]
    for d in described:
        assert d["read_only"] is False and "refused while the node is configured" in d["additional_constraints"]
    # the empty-list default is an empty integer array, not a byte array
    assert out["values"][0] == {"type": T.PARAMETER_INTEGER_ARRAY, "integer_array": []}


def test_set_while_active_is_refused_saying_when_it_applies(server, module_env):
    out = run_client(module_env, {"mode": "params", "node": "/spec_edge", "describe": ["graphs.max_context"],
                                  "set": {"graphs.max_context": 100000}})
    result, = out["set"]
    assert result["successful"] is False
    assert "graphs.max_context" in result["reason"] and "active" in result["reason"]
    assert "cleanup, set, then configure" in result["reason"]


def test_set_after_cleanup_applies_at_the_next_configure(server, module_env):
    out = run_client(module_env, {
        "mode": "lifecycle", "node": "/spec_edge", "request": {"prompt": "Count to twenty.", "temperature": 0.0},
        "transitions": ["deactivate", "cleanup",
                        {"set": {"sampling.max_new_tokens": 3, "serve.speculate_k_by_load": []}},
                        {"set": {"graphs.max_context": -1}},   # still checked as it is set
                        "configure", "activate"]})
    assert out["deactivate"] and out["cleanup"] and out["configure"] and out["activate"], out
    assert out["set"][0] == [{"successful": True, "reason": ""}] * 2, out["set"]
    assert out["set"][1][0]["successful"] is False and "max_context" in out["set"][1][0]["reason"]
    assert out["served"]["success"], out["served"]["message"]
    assert out["served"]["num_tokens"] == 3 and out["served"]["finish_reason"] == "length"
