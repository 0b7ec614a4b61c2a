"""The OpenAI request bodies the door takes (pydantic) and their translation: a body -> GenerateRequest, an
Outcome -> a response or stream chunk. Field names are OpenAI's; the project's own fields are extra body fields
named as vLLM / llama.cpp's servers name them (top_k, min_p, repetition_penalty, ignore_eos) or as ours are (drafter,
k, speculate, grammar, regex). A field the door does not know is refused (400), not ignored. A chat message's
`image_url` parts carry inline `data:` URLs only (the robot fetches nothing): each becomes an ImageInput and an
IMAGE_MARKER at the part's place in the text."""
from __future__ import annotations

import base64
import binascii
import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spec_edge.runtime.requests import (IMAGE_MARKER, ChatMessage, GenerateRequest, ImageInput, RequestError, Tool,
                                        ToolCall)
from spec_edge.runtime.scheduler import Outcome
from spec_edge.runtime.tool_format import openai_calls

# our finish reasons -> OpenAI's ("error" and "cancelled" never reach a client as a finished choice)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length", "tool_calls": "tool_calls"}
DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[^;,]*)*),(.*)", re.DOTALL)  # data:<mime>[;params],<payload>
IMAGE_TYPES = {"image/jpeg": "jpeg", "image/jpg": "jpeg", "image/png": "png"}  # a data URL's media type -> encoding


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Function(Strict):
    name: str
    arguments: str


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: Function


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted: the model's processor decides the resolution


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL

    def image(self, name: str) -> ImageInput:
        """The part's inline image; RequestError naming it as `name` for a remote or malformed URL."""
        url = self.image_url.url
        if re.match(r"https?://", url, re.IGNORECASE):
            raise RequestError(f"{name} is a remote URL ({url[:60]}): this server fetches nothing; send the image "
                               "inline as a data URL (data:image/jpeg;base64,... or data:image/png;base64,...)")
        match = DATA_URL.fullmatch(url)
        if match is None:
            raise RequestError(f"{name} is not a data URL ({url[:40]!r}): send data:image/jpeg;base64,... or "
                               "data:image/png;base64,...")
        media, params, payload = match.group(1) or "", match.group(2), match.group(3)
        if media.lower() not in IMAGE_TYPES:
            raise RequestError(f"{name} is a data URL of type '{media}': send image/jpeg or image/png")
        if ";base64" not in params.lower():
            raise RequestError(f"{name} is not base64 (data:{media}{params},...): send data:{media};base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{name}'s data is not valid base64: send the file's bytes base64-encoded") from None
        return ImageInput(data=data, encoding=IMAGE_TYPES[media.lower()])


class Message(Strict):
    role: str
    content: str | list[TextPart | ImagePart] | None = None   # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None                  # tool turns

    def chat_message(self, index: int) -> tuple[ChatMessage, tuple[ImageInput, ...]]:
        """(the turn, with an IMAGE_MARKER where each image part was; those images in order); index: this message's
        place in the body (refusals name its parts)."""
        parts = [self.content or ""] if isinstance(self.content, str | None) else self.content
        text = "".join(p if isinstance(p, str) else p.text if isinstance(p, TextPart) else IMAGE_MARKER
                       for p in parts)
        images = tuple(p.image(f"messages[{index}].content[{j}].image_url") for j, p in enumerate(parts)
                       if isinstance(p, ImagePart))
        return ChatMessage("system" if self.role == "developer" else self.role, text, tuple(
            ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()),
            self.tool_call_id or ""), images


class FunctionSpec(Strict):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None       # accepted: every call is valid against parameters anyway


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchema(Strict):
    name: str = ""
    description: str = ""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class Common(Strict):
    """The fields /v1/chat/completions and /v1/completions share."""
    model: str | None = None           # None: the model this door serves
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None            # OpenAI's end-user id: accepted, not used
    # the project's own (vLLM / llama.cpp names where they have them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    drafter: str | None = None
    k: int | None = None
    speculate: bool = True
    grammar: str = ""
    regex: str = ""

    def fields(self) -> dict[str, Any]:
        """The GenerateRequest fields both endpoints share."""
        if self.n != 1:
            raise RequestError(f"n={self.n}: this server returns one choice per request (n=1): send n requests")
        bias = []
        for key, value in (self.logit_bias or {}).items():
            try:
                bias.append((int(key), float(value)))
            except ValueError:
                raise RequestError(f"logit_bias key {key!r} is not a token id: use token ids as strings, "
                                   "e.g. {\"42\": -100}") from None
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias), ignore_eos=self.ignore_eos,
                    seed=self.seed, stop=stop, speculate=self.speculate, drafter=self.drafter, k=self.k,
                    grammar=self.grammar, regex=self.regex)


class ChatBody(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def names(self) -> dict[str, str]:
        """The request fields the engine's refusals name (the ROS / CLI names) -> this body's fields."""
        return {"max_new_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens",
                "json_schema": "response_format"}

    def request(self) -> GenerateRequest:
        if not self.messages:
            raise RequestError("messages is empty: send at least one message")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        turns = [message.chat_message(i) for i, message in enumerate(self.messages)]
        messages, images = [turn for turn, _ in turns], tuple(image for _, found in turns for image in found)
        tools = tuple(Tool(t.function.name, t.function.description, json.dumps(
            t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}))
            for t in self.tools or ())
        choice = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else (
            self.tool_choice or "auto")
        schema = ""
        if self.response_format is not None and self.response_format.type == "json_object":
            schema = json.dumps({"type": "object"})
        elif self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise RequestError("response_format json_schema needs its json_schema: {\"name\": ..., \"schema\": {...}}")
            schema = json.dumps(self.response_format.json_schema.schema_)
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return GenerateRequest(messages=tuple(messages), images=images, max_new_tokens=max_new, json_schema=schema,
                               tools=tools,
                               tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls, logprobs=max(self.top_logprobs or 0, 1) if self.logprobs else 0, **self.fields())


class CompletionBody(Common):
    prompt: str | list[str]
    logprobs: int | None = None        # the top N of each token (OpenAI: at most 5; here at most 20)
    echo: Literal[False] = False

    def names(self) -> dict[str, str]:
        """The request fields the engine's refusals name (the ROS / CLI names) -> this body's fields."""
        return {"max_new_tokens": "max_tokens"}

    def request(self) -> GenerateRequest:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise RequestError(f"prompt holds {len(prompts)} prompts: send one per request")
        return GenerateRequest(prompt=prompts[0], chat=False, max_new_tokens=self.max_tokens,
                               logprobs=max(self.logprobs, 1) if self.logprobs is not None else 0, **self.fields())


def in_openai_words(body: ChatBody | CompletionBody, message: str) -> tuple[str, str | None]:
    """(an engine refusal's message with the fields named as this body names them, the first such field: the
    error's param) (docs/http.md, "Refusals")."""
    param = None
    for ours, theirs in body.names().items():
        message, n = re.subn(rf"(?<![\w.]){ours}\b", theirs, message)  # not sampling.max_new_tokens
        param = param or (theirs if n else None)
    return message, param


def usage(outcome: Outcome) -> dict[str, int]:
    prompt = int(outcome.stats.get("prompt_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": outcome.num_tokens,
            "total_tokens": prompt + outcome.num_tokens}


def ours(outcome: Outcome) -> dict[str, Any]:
    """The `spec_edge` object beside OpenAI's fields: our finish reason, the token ids and the speculation stats."""
    return {"finish_reason": outcome.finish_reason, "message": outcome.message, "token_ids": outcome.token_ids,
            "stats": outcome.stats}


def chat_logprobs(outcome: Outcome, top: int, piece) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [entry(e.token_id, e.logprob) | {"top_logprobs": [
        entry(t, lp) for t, lp in zip(e.top_ids[:top], e.top_logprobs[:top])]} for e in outcome.logprobs]}


def completion_logprobs(outcome: Outcome, top: int, piece) -> dict[str, Any]:
    tokens = [piece(e.token_id) for e in outcome.logprobs]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in outcome.logprobs],
            "top_logprobs": [{piece(t): lp for t, lp in zip(e.top_ids[:top], e.top_logprobs[:top])}
                             for e in outcome.logprobs], "text_offset": offsets}


def choice(body: ChatBody | CompletionBody, outcome: Outcome | None, text: str, piece) -> dict[str, Any]:
    """One choice of a response (outcome given) or of a stream chunk carrying text (outcome None)."""
    chat = isinstance(body, ChatBody)
    out: dict[str, Any] = {"index": 0, "finish_reason": None if outcome is None else FINISH.get(outcome.finish_reason),
                           "logprobs": None}
    if outcome is not None and outcome.logprobs:
        out["logprobs"] = (chat_logprobs(outcome, body.top_logprobs or 0, piece) if chat
                           else completion_logprobs(outcome, body.logprobs or 0, piece))
    if not chat:
        return out | {"text": text}
    calls = openai_calls(outcome.tool_calls if outcome is not None else ())
    if body.stream:  # the calls arrive whole, in the last chunk
        delta = {"content": text} if text or outcome is not None else {"role": "assistant", "content": ""}
        return out | {"delta": delta | ({"tool_calls": [{"index": i} | c for i, c in enumerate(calls)]} if calls else {})}
    return out | {"message": {"role": "assistant", "content": text if text or not calls else None}
                  | ({"tool_calls": calls} if calls else {})}


def envelope(body: ChatBody | CompletionBody, rid: str, created: int, model: str) -> dict[str, Any]:
    kind = "chat.completion" if isinstance(body, ChatBody) else "text_completion"
    return {"id": rid, "object": kind + (".chunk" if body.stream and kind == "chat.completion" else ""),
            "created": created, "model": model}


def new_id(body: ChatBody | CompletionBody) -> tuple[str, int]:
    return ("chatcmpl-" if isinstance(body, ChatBody) else "cmpl-") + f"{time.time_ns():x}", int(time.time())
