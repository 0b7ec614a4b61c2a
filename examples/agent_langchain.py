"""A robot agent over the HTTP door with LangChain: ChatOpenAI pointed at spec_edge's OpenAI-compatible API, the
robot's tools bound with bind_tools, and the loop an agent runs (invoke, run each tool call, send a ToolMessage per
result, invoke again until the answer is text). With the door running (`spec-edge http`, or the node with
http:=true):

    python examples/agent_langchain.py "Fetch the cup from the kitchen." --base-url http://127.0.0.1:8000/v1

The same loop over the ROS service: examples/agent_ros.py. Every call parses and its arguments are valid against
the tool's schema (the door constrains the output); which tool a model picks is the model's quality.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # robot_tools, beside this file

from robot_tools import SYSTEM_PROMPT, Robot, openai_tools  # noqa: E402


def run(base_url: str, instruction: str, *, api_key: str = "unused", model: str = "smollm2-135m",
        tool_choice: str = "auto", max_turns: int = 4, max_tokens: int = 96) -> tuple[Robot, list]:
    """(the robot after the run, the LangChain messages: the instruction, each AIMessage and ToolMessage, the answer
    last). Every invoke but the last binds tool_choice; the last binds "none", so the run ends in a text answer."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=max_tokens,
                     max_retries=0)
    # parallel_tool_calls false: one action per answer, the next chosen once its result is in
    acting = llm.bind_tools(openai_tools(), tool_choice=tool_choice, parallel_tool_calls=False)
    answering = llm.bind_tools(openai_tools(), tool_choice="none")
    robot = Robot()
    functions = robot.functions()
    messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(instruction)]
    for turn in range(1, max_turns + 1):
        reply = (acting if turn < max_turns else answering).invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return robot, messages
        for call in reply.tool_calls:  # {"name", "args" (parsed), "id"}
            messages.append(ToolMessage(functions[call["name"]](**call["args"]), tool_call_id=call["id"]))
    raise RuntimeError(f"invoke {max_turns} bound tool_choice none and still got tool calls")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("instruction")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the door's http.api_key where it has one")
    parser.add_argument("--model", default="smollm2-135m", help="the served model's id (GET /v1/models: runtime.profile)")
    parser.add_argument("--tool-choice", default="auto", help="auto | required | a tool's name (each call but the last)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object: the robot's log and the answer")
    args = parser.parse_args(argv)
    robot, messages = run(args.base_url, args.instruction, api_key=args.api_key, model=args.model,
                          tool_choice=args.tool_choice, max_turns=args.max_turns)
    if args.json:
        print(json.dumps({"log": robot.log, "answer": messages[-1].content}, ensure_ascii=False))
    else:
        for name, arguments in robot.log:
            print(f"[{name}({json.dumps(arguments)})]")
        print(messages[-1].content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
