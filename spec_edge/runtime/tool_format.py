"""Tool calls in one model family's syntax (docs/tools.md): a ToolFormat renders the tools, the assistant's earlier
calls and the tool results into the prompt, builds the constraint of a request's tool_choice in two spellings of one
language (an llguidance Lark grammar for the CPU path, an XGrammar structural tag for Edge-LLM; each tool's arguments
its JSON Schema: a call always parses and validates), and parses the output into content text and ToolCalls.

Three families, picked by for_template from the model's chat template:
- HermesFormat: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional text, rendered by
  the template where it takes `tools` and knows `<tool_call>` (Qwen2.5 / Qwen3, Hermes), else generically for
  templates without tools (the embedded SmolLM2: the tools listed in the system turn, assistant calls as blocks in
  its content, tool results as user turns in `<tool_response>` blocks).
- LlamaJsonFormat: Llama 3.1 / 3.2's JSON custom tool calls, the assistant's whole message
  `{"name": ..., "parameters": {...}}`, one call per turn, tool results in role ipython (all rendered by the template).
- MistralFormat: Mistral's v3-tokenizer templates, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` as the
  whole message, call ids of 9 letters and digits, tool results in `[TOOL_RESULTS]` (rendered by the template).
"""
from __future__ import annotations

import json
import re
import hashlib
import secrets
import string
from collections.abc import Callable, Sequence
from typing import Protocol

from spec_edge.runtime.grammar import JSON_LAYOUT
from spec_edge.runtime.requests import ChatMessage, RequestError, Tool, ToolCall, TOOL_CHOICES

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NEWLINE = "\n"


ALNUM = string.ascii_letters + string.digits
MISTRAL_ID = "[A-Za-z0-9]{9}"  # a Mistral call id (its templates check for 9 letters and digits)


def new_call_id() -> str:
    """A call id ("call_" + 24 hex digits: unique per request, and across requests in practice)."""
    return "call_" + secrets.token_hex(12)


def new_mistral_id() -> str:
    """A Mistral call id: 9 letters and digits (what its templates accept; 62^9: unique in practice)."""
    return "".join(secrets.choice(ALNUM) for _ in range(9))


def mistral_id(call_id: str) -> str:
    """The id a Mistral template gets for a call id: itself when 9 letters and digits, else 9 of them derived from
    it (the same for the call and its tool turn, so ids of any client or format carry through)."""
    if re.fullmatch(MISTRAL_ID, call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(ALNUM[number // 62 ** i % 62] for i in range(9))


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


def without(markup: Sequence[str]) -> str:
    """A Lark regex term (`& ~/.../`) refusing text that contains any of markup (`/` escaped for Lark)."""
    alternatives = "|".join(re.escape(m).replace("/", "\\/") for m in markup)
    return f"& ~/(.|\\n)*({alternatives})(.|\\n)*/"


def lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def tool_specs(tools: Sequence[Tool]) -> list[dict]:
    """The tools as Hugging Face templates take them (OpenAI's {"type": "function", "function": {...}})."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}} for t in tools]


def openai_calls(calls: Sequence[ToolCall]) -> list[dict]:
    """Tool calls in OpenAI's wire shape ({"id", "type": "function", "function": {"name", "arguments": JSON text}}):
    the HTTP door's answers and the remote decoder's requests."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def template_turns(messages: Sequence[ChatMessage], call_id: Callable[[str], str] = str) -> list[dict]:
    """The messages as Hugging Face templates take them: assistant calls as `tool_calls` ({"id", "type",
    "function": {"name", "arguments": a dict}}), tool turns with `tool_call_id`; call_id maps each id."""
    return [{"role": m.role, "content": m.content} | (
        {"tool_calls": [{"id": call_id(c.id), "type": "function", "function": {
            "name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]} if m.tool_calls else {})
        | ({"tool_call_id": call_id(m.tool_call_id)} if m.role == "tool" else {}) for m in messages]


def callable_names(schemas: dict[str, dict], choice: str) -> list[str]:
    """The tools a call may name under tool_choice (a tool's name: that one; else all)."""
    return [choice] if choice in schemas else list(schemas)


def arguments_schema(schema: dict) -> dict:
    """The JSON Schema a call's arguments are held to: the tool's, with its properties only unless it says otherwise
    (OpenAI's strict mode does the same)."""
    return {"additionalProperties": False, **schema}


def call_head(name: str, key: str) -> str:
    """The start of a JSON call object up to its arguments: `{"name": N, "<key>": `."""
    return '{"name": ' + json.dumps(name) + f', "{key}": '


def call_bodies(schemas: dict[str, dict], choice: str, key: str, tail: str = "") -> list[str]:
    """Lark rules `body` (one call object of any tool, or of the named one): `{"name": N, "<key>": ARGS<tail>}`,
    ARGS the tool's JSON Schema (%json), tail a rule name (optional, after the arguments) or ""."""
    names = callable_names(schemas, choice)
    rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(names)))}"]
    for i, name in enumerate(names):
        schema = {**arguments_schema(schemas[name]), "x-guidance": JSON_LAYOUT}
        schema = json.dumps(schema).replace("::=", "\\u003a:=")  # not GBNF
        rules.append(f'body_{i}: {lark_literal(call_head(name, key))} args_{i}{" " + tail + "?" if tail else ""} "}}"')
        rules.append(f"args_{i}: %json {schema}")
    return rules


# XGrammar structural tags (the xgrammar 0.2 format that Edge-LLM's binary vendors: docs/tensorrt.md, "Tool calls on
# Edge-LLM"): each format's structural_tag spells its grammar's language with these pieces.
def xg_text(text: str) -> dict:
    return {"type": "const_string", "value": text}


def xg_regex(pattern: str) -> dict:
    return {"type": "regex", "pattern": pattern}


def xg_any_of(*elements: dict) -> dict:
    return {"type": "or", "elements": list(elements)}


def xg_sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def xg_structural_tag(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def call_tags(schemas: dict[str, dict], choice: str, around: Callable[[str], tuple[str, str]],
              tail: dict | None = None) -> list[dict]:
    """XGrammar `tag`s, one per tool a call may name: around(name) = (begin, end) of the call, between them the
    arguments (arguments_schema) and, where given, an optional tail."""
    tags = []
    for name in callable_names(schemas, choice):
        begin, end = around(name)
        content = {"type": "json_schema", "json_schema": arguments_schema(schemas[name])}
        if tail is not None:
            content = xg_sequence(content, {"type": "optional", "content": tail})
        tags.append({"type": "tag", "begin": begin, "end": end, "content": content})
    return tags


def tag_calls(tags: list[dict], separator: str, parallel: bool) -> dict:
    """One call of the tags, or (parallel) one or more separated by separator."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}


def decode_objects(text: str, at: int) -> list[dict]:
    """The complete JSON objects at text[at:] separated by commas / whitespace (a list's items; stops at the
    first that is cut short or is not an object)."""
    decoder, found = json.JSONDecoder(), []
    while True:
        while at < len(text) and text[at] in ", \n\t":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return found
        if not isinstance(item, dict):
            return found
        found.append(item)


class ToolFormat(Protocol):
    """One model family's call syntax (docs/tools.md, "Adding a family")."""

    def render(self, tokenizer, messages: list[ChatMessage], tools: Sequence[Tool]) -> str:
        """The prompt: the tools, the assistant's earlier calls and the tool results."""

    def grammar(self, schemas: dict[str, dict], choice: str, parallel: bool) -> str:
        """The Lark grammar of the output under tool_choice (tools given)."""

    def structural_tag(self, schemas: dict[str, dict], choice: str, parallel: bool) -> dict:
        """grammar's language as an XGrammar structural tag (the constraint on Edge-LLM)."""

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content without call markup, the complete calls with ids) of an output."""

    def content_stream(self) -> ContentStream:
        """What holds call markup back from the streamed content."""


class HermesFormat:
    """`<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one block per call, after optional text."""
    opener, closer = "<tool_call>\n", "\n</tool_call>"
    TOOL_TURNS = "<tool_response>\n{}\n</tool_response>"
    # what the text never holds: every tag of the format (<tool_call>, </tool_call>, <tool_response>,
    # </tool_response>, <tools>) and the ones a model makes up from them (<tool_call_body>, <tool_result>)
    markup = ("<tool", "</tool")

    def __init__(self, native: bool):
        self.native = native  # the chat template renders tools, calls and tool turns itself

    # -- the prompt
    def render(self, tokenizer, messages: list[ChatMessage], tools: Sequence[Tool]) -> str:
        specs = tool_specs(tools)
        if self.native:
            return tokenizer.render_chat(template_turns(messages), tools=specs or None)
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
        """The Lark grammar of the output under tool_choice (tools given): `none` free text without the markup,
        `auto` that text then optionally calls, `required` / a name only calls (one, or several when parallel)."""
        free = f"FREE: /(.|\\n)*/ {without(self.markup)}"
        if choice == "none":
            return f"start: FREE\n{free}\n"
        rules = call_bodies(schemas, choice, "arguments")
        more = f' ({lark_literal(self.closer + NEWLINE + self.opener)} body)*' if parallel else ""
        calls = f"body{more} {lark_literal(self.closer)}"
        start = (f"start: {lark_literal(self.opener)} {calls}" if choice != "auto" else
                 f"start: FREE | OPENED {calls}\nOPENED: FREE {lark_literal(self.opener)}\n{free}")
        return "\n".join([start] + rules) + "\n"

    def structural_tag(self, schemas: dict[str, dict], choice: str, parallel: bool) -> dict:
        """grammar's language as an XGrammar structural tag: the free text an `any_text` without the markup, each
        call a `tag` of its block around the arguments, calls separated by a newline."""
        free = {"type": "any_text", "excludes": list(self.markup)}
        if choice == "none":
            return xg_structural_tag(free)
        calls = tag_calls(call_tags(schemas, choice, lambda name: tuple(self.block(name, "\0").split("\0"))),
                          NEWLINE, parallel)
        return xg_structural_tag(calls if choice != "auto" else xg_any_of(free, xg_sequence(free, calls)))

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

    def content_stream(self) -> ContentStream:
        return ContentStream(self.opener.strip())


def leading_text(opener: str) -> str:
    """The regular expression (Python's, and XGrammar's) of answers that do not start like a call: optional
    whitespace, then nothing or a character other than the opener's first (so text and a call part at their first
    visible character)."""
    return f"\\s*([^{re.escape(opener[0])}\\s][\\s\\S]*)?"


class LlamaJsonFormat:
    """Llama 3.1 / 3.2 JSON custom tool calls: the assistant's whole message is one call
    `{"name": N, "parameters": {...}}` (the official template renders calls so, one per assistant turn, and raises
    on more). parallel_tool_calls does not apply: `required` / a name give exactly one call, `auto` one call or
    text that does not start with `{`. Tools, earlier calls and tool results (role ipython) go to the template;
    its tools_in_user_message (default true) puts the tools in the first user message."""
    opener = "{"

    def render(self, tokenizer, messages: list[ChatMessage], tools: Sequence[Tool]) -> str:
        for i, m in enumerate(messages):
            if len(m.tool_calls) > 1:
                raise RequestError(f"messages[{i}] has {len(m.tool_calls)} tool_calls, but this model's format "
                                   "(Llama 3.1 JSON calls) holds one call per assistant turn: send each call as an "
                                   "assistant turn of its own, followed by its tool turn")
        return tokenizer.render_chat(template_turns(messages), tools=tool_specs(tools) or None)

    def grammar(self, schemas: dict[str, dict], choice: str, parallel: bool) -> str:
        text = f"TEXT: /{leading_text(self.opener)}/"
        if choice == "none":
            return f"start: TEXT\n{text}\n"
        start = "start: body" if choice != "auto" else f"start: body | TEXT\n{text}"
        return "\n".join([start] + call_bodies(schemas, choice, "parameters")) + "\n"

    def structural_tag(self, schemas: dict[str, dict], choice: str, parallel: bool) -> dict:
        """grammar's language as an XGrammar structural tag: one call `tag` (its JSON object around the arguments),
        or (auto) that or the text regex."""
        text = xg_regex(leading_text(self.opener))
        if choice == "none":
            return xg_structural_tag(text)
        call = xg_any_of(*call_tags(schemas, choice, lambda name: (call_head(name, "parameters"), "}")))
        return xg_structural_tag(call if choice != "auto" else xg_any_of(call, text))

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.lstrip()
        if not body.startswith(self.opener):
            return text, []
        calls = [ToolCall(new_call_id(), str(c["name"]), json.dumps(c["parameters"]))
                 for c in decode_objects(body, 0)[:1] if "name" in c and isinstance(c.get("parameters"), dict)]
        return "", calls

    def content_stream(self) -> ContentStream:
        return ContentStream(self.opener, leading=True)


class MistralFormat:
    """Mistral's v3-tokenizer templates: the assistant's whole message is `[TOOL_CALLS]` and a JSON list of calls
    `[{"name": N, "arguments": {...}}, ...]` (", " between calls, `[TOOL_CALLS] [` with the space where the
    template writes it so), each with an optional `"id"` of 9 letters and digits (the model's, else a new one).
    `auto`: the calls, or text that does not start with `[`. The opener is the tokenizer's `[TOOL_CALLS]` token
    where it has one (token: its id; decoding skips it as a special token), else the text. Ids going to the
    template are mapped to 9 letters and digits (mistral_id), which its templates require."""
    opener = "[TOOL_CALLS]"
    markup = ("[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")

    def __init__(self, spaced: bool, token: int | None):
        self.spaced, self.token = spaced, token

    def render(self, tokenizer, messages: list[ChatMessage], tools: Sequence[Tool]) -> str:
        return tokenizer.render_chat(template_turns(messages, mistral_id), tools=tool_specs(tools) or None)

    def grammar(self, schemas: dict[str, dict], choice: str, parallel: bool) -> str:
        text = f"TEXT: /{leading_text('[')}/ {without(self.markup)}"
        if choice == "none":
            return f"start: TEXT\n{text}\n"
        opener = f"<[{self.token}]>" if self.token is not None else lark_literal(self.opener)
        more = f' ({lark_literal(", ")} body)*' if parallel else ""
        calls = f"{opener} {lark_literal(' [' if self.spaced else '[')} body{more} \"]\""
        start = f"start: {calls}" if choice != "auto" else f"start: {calls} | TEXT\n{text}"
        ids = ['call_id: ", \\"id\\": \\"" ID "\\""', f"ID: /{MISTRAL_ID}/"]
        return "\n".join([start] + call_bodies(schemas, choice, "arguments", "call_id") + ids) + "\n"

    def structural_tag(self, schemas: dict[str, dict], choice: str, parallel: bool) -> dict:
        """grammar's language as an XGrammar structural tag: the opener (a `token`, named by its text, where the
        tokenizer has it as one: Edge-LLM gives XGrammar every token's piece, special ones included), the list's
        calls as `tag`s (the JSON object around the arguments and the optional id) separated by ", "; the text:
        whitespace, or a first visible character other than `[` and then `any_text` without the markup."""
        text = xg_any_of(xg_regex("\\s*"), xg_sequence(xg_regex("\\s*[^\\[\\s]"),
                                                         {"type": "any_text", "excludes": list(self.markup)}))
        if choice == "none":
            return xg_structural_tag(text)
        call_id = xg_sequence(xg_text(', "id": "'), xg_regex(MISTRAL_ID), xg_text('"'))
        calls = xg_sequence(
            {"type": "token", "token": self.opener} if self.token is not None else xg_text(self.opener),
            xg_text(" [" if self.spaced else "["),
            tag_calls(call_tags(schemas, choice, lambda name: (call_head(name, "arguments"), "}"), call_id),
                      ", ", parallel),
            xg_text("]"))
        return xg_structural_tag(calls if choice != "auto" else xg_any_of(calls, text))

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.lstrip()
        body = body[len(self.opener):].lstrip() if body.startswith(self.opener) else body
        if not body.startswith("["):
            return text, []
        calls: list[ToolCall] = []
        for c in decode_objects(body, 1):
            if "name" in c and isinstance(c.get("arguments"), dict):
                given = str(c.get("id", ""))  # the model's id, unless it is not one or repeats one
                fresh = re.fullmatch(MISTRAL_ID, given) and given not in {k.id for k in calls}
                calls.append(ToolCall(given if fresh else new_mistral_id(), str(c["name"]), json.dumps(c["arguments"])))
        return "", calls

    def content_stream(self) -> ContentStream:
        return ContentStream("[", leading=True)


def for_template(chat_template: str, token_id: Callable[[str], int | None] = lambda text: None) -> ToolFormat:
    """The tool format of a model's chat template (docs/tools.md: the formats, how to add a family); token_id:
    the tokenizer's id of a text that is one token (None otherwise). Mistral's later `[TOOL_CALLS]name[ARGS]{...}`
    templates (tokenizer v11) are not this family's syntax: they get the generic format."""
    if "[TOOL_CALLS]" in chat_template and "[ARGS]" not in chat_template:
        return MistralFormat(spaced="[TOOL_CALLS] [" in chat_template, token=token_id("[TOOL_CALLS]"))
    if "<|start_header_id|>" in chat_template and '"parameters": ' in chat_template and "tools" in chat_template:
        return LlamaJsonFormat()
    return HermesFormat(native="tools" in chat_template and "<tool_call>" in chat_template)


class Answer:
    """A request's answer as it streams and as it ends, the same on every decoder: without a tool format the text
    passes through; with one, call markup is held back from the stream (the format's content_stream) and the calls
    are split out of the text at the end (finish_reason tool_calls where the output ended in calls)."""

    def __init__(self, fmt: ToolFormat | None):
        self.fmt = fmt
        self.content = fmt.content_stream() if fmt is not None else None

    def push(self, delta: str) -> str:
        """The part of delta to stream."""
        return self.content.push(delta) if self.content is not None else delta

    def finish(self, text: str, finish: str) -> tuple[str, str, list[ToolCall], str]:
        """(what was held back and is content after all: stream it, the content, the calls, the finish reason) of
        the whole output text and the decoder's finish reason."""
        if self.fmt is None:
            return "", text, [], finish
        rest = self.content.finish()
        text, calls = self.fmt.split(text)
        return rest, text, calls, "tool_calls" if calls and finish == "eos" else finish


class ContentStream:
    """Streamed text with call markup held back: push(delta) -> the part that is surely content (text that may be
    the start of the opener waits; from the opener on, nothing more). leading: a call is the whole message (Llama,
    Mistral): the text waits until its first visible character, then is all content or (the opener's) all call."""

    def __init__(self, opener: str, leading: bool = False):
        self.opener, self.leading, self.sent, self.text, self.closed = opener, leading, 0, "", False
        self.plain = False  # leading, and the first visible character was not the opener's: all content

    def push(self, delta: str) -> str:
        if self.closed:
            return ""
        self.text += delta
        if self.leading:
            if not self.plain:
                if not self.text.strip():
                    return ""
                self.closed = self.text.lstrip().startswith(self.opener)
                self.plain = not self.closed
                delta = "" if self.closed else self.text
            self.sent = len(self.text)
            return delta
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
