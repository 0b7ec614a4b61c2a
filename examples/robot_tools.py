"""The robot tools of the agent examples (agent_ros.py, agent_langchain.py): move_to(place), pick(object) and
say(text) as spec_edge Tools (their JSON Schemas are what every call is constrained to), and a Robot whose methods
run them; here it only keeps a log of what it did, on a robot they would send goals to its navigation and arm."""
from __future__ import annotations

import json

from spec_edge.runtime.requests import Tool

ROOMS = ("kitchen", "living_room", "bedroom", "bathroom", "hallway")
SYSTEM_PROMPT = ("You control a home robot. Use the tools to act: move_to a room, pick an object, say a sentence. "
                 "After the tools answered, tell the user in one short sentence what you did.")


def _arguments(**properties: dict) -> str:
    """The JSON Schema of a tool's arguments, every one required, nothing else allowed (strings bounded: a small
    model's call cannot run on to max_new_tokens)."""
    return json.dumps({"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False})


TOOLS = (
    Tool("move_to", "Drive the robot to a room of the house.",
         _arguments(place={"type": "string", "enum": list(ROOMS)})),
    Tool("pick", "Pick up an object within the robot's reach.",
         _arguments(object={"type": "string", "minLength": 1, "maxLength": 40})),
    Tool("say", "Say a sentence aloud through the robot's speaker.",
         _arguments(text={"type": "string", "minLength": 1, "maxLength": 160})),
)


def openai_tools() -> list[dict]:
    """TOOLS in OpenAI's shape ({"type": "function", "function": {...}}: what the HTTP door, the `openai` client and
    LangChain's bind_tools take)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}} for t in TOOLS]


class Robot:
    """Runs the tools; each returns the sentence the model reads as the tool's result."""

    def __init__(self) -> None:
        self.place = "hallway"
        self.holding: list[str] = []
        self.log: list[tuple[str, dict]] = []  # (tool name, arguments) in the order run

    def move_to(self, place: str) -> str:
        self.log.append(("move_to", {"place": place}))
        self.place = place
        return f"arrived in the {place.replace('_', ' ')}"

    def pick(self, object: str) -> str:  # noqa: A002 (the tool's argument name)
        self.log.append(("pick", {"object": object}))
        self.holding.append(object)
        return f"holding the {object} (in the {self.place.replace('_', ' ')})"

    def say(self, text: str) -> str:
        self.log.append(("say", {"text": text}))
        return "said"

    def functions(self) -> dict:
        """Each tool's name -> the method that runs it."""
        return {"move_to": self.move_to, "pick": self.pick, "say": self.say}
