"""Tool calls in one model family's syntax (docs/tools.md): a ToolFormat renders the tools, the assistant's earlier
calls and the tool results into the prompt, builds the grammar of a request's tool_choice (llguidance Lark, with
each tool's arguments as an embedded JSON Schema: a call always parses and validates), and parses the output into
content text and ToolCalls.

One format today, Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, in two renderings
(for_template picks): the template's own where it takes `tools` and knows `<tool_call>` (Qwen2.5 / Qwen3,
Hermes), else the generic one for templates without tools (the embedded SmolLM2): the tools listed in the system
turn, assistant calls as blocks in its content, tool results as user turns in `<tool_response>` blocks.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence

from spec_edge.runtime.grammar import JSON_LAYOUT
from spec_edge.runtime.requests import ChatMessage, RequestError, Tool, ToolCall, TOOL_CHOICES

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def new_call_id() -> str:
    """A call id ("call_" + 24 hex digits: unique per request, and across requests in practice)."""
    return "call_" + secrets.token_hex(12)


def check_tools(tools: Sequence[Tool], choice: str) -> dict[str, dict]:
    """{name: parsed schema} of a request's tools; RequestError for a bad name, a duplicate, a schema that is not a
    JSON object, or a tool_choice that is not auto / none / required / one of the tools' names."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not NAME.fullmatch(tool.name):
            raise RequestError(f"tools[{i}] name {tool.name!r} must be 1-64 of A-Z a-z 0-9 _ -")
        if tool.name in schemas:
            raise RequestError(f"tools[{i}]: the tool name '{tool.name}' is given twice: names must be unique")
        try:
            schema = json.loads(tool.parameters or '{"type": "object", "properties": {}}')
        except json.JSONDecodeError as err:
            raise RequestError(f"tools[{i}] ({tool.name}) parameters is not valid JSON: {err}") from None
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise RequestError(f"tools[{i}] ({tool.name}) parameters must be a JSON Schema of an object "
                               '({"type": "object", "properties": {...}})')
        schemas[tool.name] = schema
    if choice not in TOOL_CHOICES + tuple(schemas) or not tools and choice not in ("auto", "none"):
        known = ", ".join(TOOL_CHOICES + tuple(schemas))
        raise RequestError(f"tool_choice '{choice}' is neither {', '.join(TOOL_CHOICES)} nor a tool's name "
                           f"(use one of {known})" if tools else
                           f"tool_choice '{choice}' needs tools: send tools, or tool_choice auto")
    return schemas


def tools_from_json(text: str) -> tuple[Tool, ...]:
    """Tools from a JSON list of OpenAI tools ({"type": "function", "function": {...}}) or of the function objects
    themselves ({"name", "description", "parameters"}); RequestError for anything else."""
    try:
        items = json.loads(text)
        return tuple(Tool(f["name"], f.get("description", ""), json.dumps(f.get("parameters", {"type": "object"})))
                     for f in (item.get("function", item) if item.get("type", "function") == "function" else None
                               for item in items))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as err:
        raise RequestError(f"tools must be a JSON list of OpenAI tools ({{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": {{...}}}}}}): {type(err).__name__}: {err}") from None


def lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


class HermesFormat:
    """`<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one block per call, after optional text."""
    opener, closer = "<tool_call>\n", "\n</tool_call>"
    TOOL_TURNS = "<tool_response>\n{}\n</tool_response>"

    def __init__(self, native: bool):
        self.native = native  # the chat template renders tools, calls and tool turns itself

    # -- the prompt
    def render(self, tokenizer, messages: list[ChatMessage], tools: Sequence[Tool]) -> str:
        specs = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": json.loads(t.parameters)}} for t in tools]
        if self.native:
            turns = [{"role": m.role, "content": m.content} | (
                {"tool_calls": [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]}
                if m.tool_calls else {}) | ({"tool_call_id": m.tool_call_id} if m.role == "tool" else {})
                for m in messages]
            return tokenizer.render_chat(turns, tools=specs or None)
        pairs = [(m.role, m.content) if m.role != "tool" else ("user", self.TOOL_TURNS.format(m.content))
                 for m in messages]
        pairs = [(role, "\n".join([content] * bool(content) + [self.block(c.name, c.arguments) for c in m.tool_calls]))
                 for (role, content), m in zip(pairs, messages)]
        if specs:
            listing = ("You can call these tools (their JSON Schemas):\n<tools>\n"
                       + "\n".join(json.dumps(s["function"]) for s in specs) + "\n</tools>\nTo call a tool, answer "
                       + self.block("<tool name>", '{"<argument>": <value>}') + " (one block per call).")
            if pairs and pairs[0][0] == "system":
                pairs[0] = ("system", pairs[0][1] + "\n\n" + listing)
            else:
                pairs.insert(0, ("system", listing))
        return tokenizer.render_chat(pairs)

    def block(self, name: str, arguments: str) -> str:
        return f'{self.opener}{{"name": "{name}", "arguments": {arguments}}}{self.closer}'

    # -- the constraint
    def grammar(self, schemas: dict[str, dict], choice: str, parallel: bool) -> str:
        """The Lark grammar of the output under tool_choice (tools given): `none` free text without the opener,
        `auto` that text then optionally calls, `required` / a name only calls (one, or several when parallel)."""
        free = 'FREE: /(.|\\n)*/ & ~/(.|\\n)*' + re.escape(self.opener.strip()) + '(.|\\n)*/'
        if choice == "none":
            return f"start: FREE\n{free}\n"
        names = [choice] if choice in schemas else list(schemas)
        rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(names)))}"]
        for i, name in enumerate(names):
            # arguments hold the schema's properties only, unless it says otherwise (OpenAI's strict mode does the same)
            schema = {"additionalProperties": False, **schemas[name], "x-guidance": JSON_LAYOUT}
            schema = json.dumps(schema).replace("::=", "\\u003a:=")  # not GBNF
            rules.append(f'body_{i}: {lark_literal("{" + chr(34) + "name" + chr(34) + ": " + json.dumps(name))} '
                         f'{lark_literal(", " + chr(34) + "arguments" + chr(34) + ": ")} args_{i} "}}"')
            rules.append(f"args_{i}: %json {schema}")
        more = f' ({lark_literal(self.closer + chr(10) + self.opener)} body)*' if parallel else ""
        calls = f"body{more} {lark_literal(self.closer)}"
        start = (f"start: {lark_literal(self.opener)} {calls}" if choice != "auto" else
                 f"start: FREE | OPENED {calls}\nOPENED: FREE {lark_literal(self.opener)}\n{free}")
        return "\n".join([start] + rules) + "\n"

    # -- the output
    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content without call markup, the complete calls) of an output; ids new."""
        head, sep, rest = text.partition(self.opener.strip())
        if not sep:
            return text, []
        calls = []
        for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", sep + rest, re.S):
            try:
                call = json.loads(block)
                calls.append(ToolCall(new_call_id(), str(call["name"]), json.dumps(call["arguments"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a block cut short (length): not a call
        return head.rstrip(), calls


def for_template(chat_template: str) -> HermesFormat:
    """The tool format of a model's chat template (docs/tools.md: how to add a family)."""
    return HermesFormat(native="tools" in chat_template and "<tool_call>" in chat_template)


class ContentStream:
    """Streamed text with call markup held back: push(delta) -> the part that is surely content (text that may be
    the start of the opener waits; from the opener on, nothing more)."""

    def __init__(self, opener: str):
        self.opener, self.sent, self.text, self.closed = opener, 0, "", False

    def push(self, delta: str) -> str:
        if self.closed:
            return ""
        self.text += delta
        if (at := self.text.find(self.opener, self.sent)) >= 0:
            self.closed = True
            out = self.text[self.sent:at].rstrip()
            self.sent = at
            return out
        keep = next((n for n in range(min(len(self.opener) - 1, len(self.text)), 0, -1)
                     if self.opener.startswith(self.text[-n:])), 0)
        # trailing whitespace waits too: the content before a call is stripped of it
        end = len(self.text) - keep
        end = len(self.text[:end].rstrip()) if keep or self.text[:end].endswith(("\n", " ")) else end
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self) -> str:
        """What was held back and is content after all (the output ended without a call)."""
        if self.closed:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
