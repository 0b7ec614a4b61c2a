"""The robot tools of the agent examples (agent_ros.py, agent_langchain.py): move_to(place), pick(object) and
say(text), read from bench/robot_tools.json (the tests and the tool-call bench use the same file) as spec_edge
Tools (their JSON Schemas are what every call is constrained to), and a Robot whose methods run them; here it only
keeps a log of what it did, on a robot they would send goals to its navigation and arm."""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.runtime.tool_format import tools_from_json

TOOLS_FILE = Path(__file__).resolve().parents[1] / "bench" / "robot_tools.json"  # the one definition (OpenAI's shape)
TOOLS = tools_from_json(TOOLS_FILE.read_text())  # move_to(place: a room), pick(object), say(text)
ROOMS = tuple(json.loads(TOOLS[0].parameters)["properties"]["place"]["enum"])
SYSTEM_PROMPT = ("You control a home robot. Use the tools to act: move_to a room, pick an object, say a sentence. "
                 "After the tools answered, tell the user in one short sentence what you did.")


def openai_tools() -> list[dict]:
    """The tools in OpenAI's shape ({"type": "function", "function": {...}}: what the HTTP door, the `openai` client
    and LangChain's bind_tools take)."""
    return json.loads(TOOLS_FILE.read_text())


class Robot:
    """Runs the tools; each returns the sentence the model reads as the tool's result."""

    def __init__(self) -> None:
        self.place = ROOMS[0]
        self.holding: list[str] = []
        self.log: list[tuple[str, dict]] = []  # (tool name, arguments) in the order run

    def move_to(self, place: str) -> str:
        self.log.append(("move_to", {"place": place}))
        self.place = place
        return f"arrived in the {place}"

    def pick(self, object: str) -> str:  # noqa: A002 (the tool's argument name)
        self.log.append(("pick", {"object": object}))
        self.holding.append(object)
        return f"holding the {object} (in the {self.place})"

    def say(self, text: str) -> str:
        self.log.append(("say", {"text": text}))
        return "said"

    def functions(self) -> dict:
        """Each tool's name -> the method that runs it."""
        return {"move_to": self.move_to, "pick": self.pick, "say": self.say}
