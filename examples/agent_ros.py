"""A robot agent over the ROS door: the node's /generate service with the robot's tools, the loop run by
GenerateClient.run_tools (call, run each tool call's function, send the results back, call again until the answer
is text). With the node running (`ros2 launch spec_edge spec_edge.launch.py` or `spec-edge serve`):

    python examples/agent_ros.py "Fetch the cup from the kitchen."
    python examples/agent_ros.py "Fetch the cup from the kitchen." --tool-choice required --max-turns 2 --json

Every call parses and its arguments are valid against the tool's schema (the node constrains the output); which
tool a model picks is the model's quality: the embedded 135M model often picks badly (docs/agents.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # robot_tools, beside this file

from robot_tools import SYSTEM_PROMPT, TOOLS, Robot  # noqa: E402


def run(client: Any, instruction: str, *, tool_choice: str = "auto", max_turns: int = 4,
        max_new_tokens: int = 96) -> tuple[Robot, Any]:
    """(the robot after the run, the ToolRun) of one instruction, through client (a GenerateClient)."""
    robot = Robot()
    # parallel_tool_calls false: one action per answer, the next chosen once its result is in
    done = client.run_tools([("system", SYSTEM_PROMPT), ("user", instruction)], TOOLS, robot.functions(),
                            tool_choice=tool_choice, max_turns=max_turns, max_new_tokens=max_new_tokens,
                            parallel_tool_calls=False)
    return robot, done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("instruction")
    parser.add_argument("--tool-choice", default="auto", help="auto | required | a tool's name (each call but the last)")
    parser.add_argument("--max-turns", type=int, default=4, help="calls of the service at most (the last: text only)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--namespace", default="", help="namespace of the node")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the node")
    parser.add_argument("--json", action="store_true", help="print one JSON object: the calls, the answer, the log")
    args = parser.parse_args(argv)

    import rclpy

    from spec_edge.ros2.client import GenerateClient

    rclpy.init(args=[])
    try:
        with GenerateClient(namespace=args.namespace, wait_timeout=args.wait) as client:
            robot, done = run(client, args.instruction, tool_choice=args.tool_choice, max_turns=args.max_turns,
                              max_new_tokens=args.max_new_tokens)
    finally:
        rclpy.try_shutdown()
    if args.json:
        print(json.dumps({"calls": [dict(call.as_dict(), result=result) for call, result in done.calls],
                          "answer": done.answer.text, "finish_reason": done.answer.finish_reason,
                          "turns": len([m for m in done.messages if m.role == "assistant"]), "log": robot.log},
                         ensure_ascii=False))
    else:
        for call, result in done.calls:
            print(f"[{call.name}({call.arguments}) -> {result}]")
        print(done.answer.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
