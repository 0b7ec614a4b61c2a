"""examples/agent_langchain.py against a real HTTP door on 127.0.0.1 serving the embedded default: LangChain's
ChatOpenAI with bind_tools runs call -> tool result -> final answer. Every call is valid against its tool's schema
(the door constrains it); which tool the 135M model picks is its quality, not asserted. No network: LangChain's
token counting (tiktoken) is never reached (a tripwire says so). The same loop over the ROS service:
test/ros/test_node_tools.py."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from spec_edge import config as cfgmod

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import agent_langchain  # noqa: E402
from robot_tools import TOOLS  # noqa: E402

from spec_edge.tools.schema_check import violations  # noqa: E402

KEY = "test-key"
# the ROS tests' configuration (test/ros/rosutil.py test_params: fp32, one slot, k=4), the door on a free port
PARAMS = {"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32", "graphs.batch_slots": 1,
          "speculative.k": 4, "http.port": 0, "http.api_key": KEY}


@pytest.fixture(scope="module")
def base():
    from spec_edge import artifacts
    from spec_edge.http.door import Door
    from spec_edge.runtime.scheduler import Scheduler

    cfg = cfgmod.from_params(PARAMS)
    engine = artifacts.engine(cfg, progress=lambda m: None)
    logger = logging.getLogger("test_agents")
    door = Door(cfg, logger).start()
    scheduler = Scheduler(engine, cfg, logger)
    door.serve(scheduler, engine)
    yield f"http://127.0.0.1:{door.port}/v1"
    scheduler.stop(1.0)
    door.stop()
    engine.close()


def test_langchain_agent_runs_call_result_answer(base, tmp_path, monkeypatch):
    import tiktoken
    from langchain_core.messages import AIMessage, ToolMessage

    def no_download(*args, **kwargs):
        raise AssertionError("tiktoken asked for an encoding (it downloads it): LangChain counted tokens")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    monkeypatch.setattr(tiktoken, "encoding_for_model", no_download)
    robot, messages = agent_langchain.run(base, "Go to the kitchen and say hi.", api_key=KEY,
                                          tool_choice="required", max_turns=2)
    schemas = {t.name: json.loads(t.parameters) for t in TOOLS}
    acted, results, answer = messages[2], messages[3:-1], messages[-1]
    assert isinstance(acted, AIMessage) and acted.tool_calls, acted
    for call in acted.tool_calls:
        assert violations(call["args"], schemas[call["name"]]) == [], call
    assert [(c["name"], c["args"]) for c in acted.tool_calls] == [tuple(entry) for entry in robot.log]
    assert all(isinstance(m, ToolMessage) for m in results)
    assert [m.tool_call_id for m in results] == [c["id"] for c in acted.tool_calls]
    assert len({c["id"] for c in acted.tool_calls}) == len(acted.tool_calls)
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.content.strip()
    assert "<tool_call>" not in answer.content
    assert list(tmp_path.iterdir()) == []
