"""runtime.backend remote: a serving.Decoder whose requests an OpenAI-compatible server answers (vLLM, SGLang,
llama.cpp's server, an Edge-LLM server, another spec_edge: remote.kind), streamed back through the same sink, over
remote_link.Link (timeouts, retries before the first piece only, the circuit breaker). What each kind of server
can do is data (KINDS); the front refuses the rest in the words it uses for every decoder. A chat goes as messages
(the server renders its own template; without a local model the server also counts the prompt and refuses one
too long: its 400 comes back as the same refusal, a RequestError). logprobs are not carried (the server's token
ids are not ours).

Without a fallback the decoder has no tokenizer and its capabilities say it renders (front.Capabilities.renders):
the front checks a request's messages and hands them over in Prepared.messages, with no prompt text or ids.
remote.fallback local: the profile's own model (an ONNX Runtime decoder) runs beside it, and the front checks every
request with its tokenizer and grammars against the capabilities both can serve, so any request can go either way. A
request goes to the local model while the circuit is open, or when the server failed it before its first piece
(unreachable, timed out, 5xx); the answer says so (stats served_by "local", and its message). A request the server
was already streaming when the link broke is not restarted (its client has part of an answer): it fails with that
reason.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import openai

from spec_edge.config import DRAFTERS, Config, ConfigError
from spec_edge.runtime.backends.remote_link import Link
from spec_edge.runtime.front import Capabilities, Prepared
from spec_edge.runtime.requests import GenerateResult, RequestError, ToolCall, Unavailable
from spec_edge.runtime.serving import Decoder, Sink
from spec_edge.runtime.stats import Stats
from spec_edge.runtime.tool_format import openai_calls, tool_specs

POLL_S = 0.02  # how long iterate() waits for a remote request to end before cancels are asked again
PENALTIES = ("presence_penalty", "frequency_penalty")
EXTRA_SAMPLING = ("min_p", "repetition_penalty", "ignore_eos")  # sent as extra body fields (vLLM / llama.cpp names)
FINISH = {"stop": "eos", "length": "length", "tool_calls": "tool_calls"}  # OpenAI's -> ours (spec_edge sends ours)
UNLIMITED = 1 << 30  # the context / vocabulary bound the front checks when only the server knows it


@dataclass(frozen=True)
class Kind:
    """What a kind of server takes beyond OpenAI's chat fields. guided: the kinds the front lets through
    (json_schema goes as response_format; the others as the extra body field named in fields); sampling: the
    front's optional features it honours; top_k: it takes top_k; fields: our name -> the server's (json_schema:
    "json_object": response_format {"type": "json_object", "schema": ...}, the shape llama.cpp's servers take)."""
    guided: tuple[str, ...]
    sampling: tuple[str, ...]
    tools: bool
    top_k: bool = True
    fields: dict[str, str] = field(default_factory=dict)


_ALL = PENALTIES + EXTRA_SAMPLING
KINDS = {  # each server's own docs: docs/remote.md, "What each kind takes"
    "openai": Kind(("json_schema",), PENALTIES, tools=True, top_k=False),
    "vllm": Kind(("json_schema", "regex", "gbnf"), _ALL, True, fields={"regex": "guided_regex", "gbnf": "guided_grammar"}),
    "sglang": Kind(("json_schema", "regex", "gbnf"), _ALL, True, fields={"regex": "regex", "gbnf": "ebnf"}),
    "llama.cpp": Kind(("json_schema", "gbnf"), _ALL, True,
                      fields={"json_schema": "json_object", "gbnf": "grammar", "repetition_penalty": "repeat_penalty"}),
    "edgellm": Kind((), (), tools=False),
    "spec_edge": Kind(("json_schema", "regex", "gbnf", "lark"), _ALL, True,
                      fields={"regex": "regex", "gbnf": "grammar", "lark": "grammar"}),
}


@dataclass
class _Call:
    """A request sent to the server: its text so far (written by the link's loop thread)."""
    prepared: Prepared
    sink: Sink
    started: float
    pieces: list[str] = field(default_factory=list)
    future: Future | None = None


class RemoteDecoder:
    """serving.Decoder over a remote server (module docstring); local: the fallback engine (None: none)."""

    def __init__(self, cfg: Config, link: Link, local: Decoder | None):
        self.cfg, self.link, self.local, self.kind = cfg, link, local, KINDS[cfg.remote.kind]
        self.capacity = cfg.remote.max_concurrent
        self.tokenizer = local.tokenizer if local is not None else None
        self._calls: list[_Call] = []
        self._local_queue: collections.deque[tuple[Prepared, Sink, str]] = collections.deque()
        self._ended = threading.Event()  # set by the loop thread as a remote request ends
        caps = self.kind_capabilities()
        if local is not None:  # what both can serve, checked with the local tokenizer
            mine = local.capabilities
            caps = dataclasses.replace(mine, name=caps.name + " (local fallback)", forced_drafts=False,
                                       guided=tuple(g for g in caps.guided if g in mine.guided),
                                       sampling=tuple(s for s in caps.sampling if s in mine.sampling),
                                       tools=caps.tools and mine.tools)
        self.capabilities = caps

    def guide(self, kind: str, text: str) -> Any:
        """The fallback's compiled grammar (it may answer the request); without one, (kind, text): the server
        compiles it from the request's own field."""
        return self.local.guide(kind, text) if self.local is not None else (kind, text)

    def tool_guide(self, fmt: Any, schemas: dict[str, dict], choice: str, parallel: bool) -> Any:
        """The fallback's grammar of the tool calls; without one, None: the server constrains and parses them."""
        return self.local.tool_guide(fmt, schemas, choice, parallel) if self.local is not None else None

    @classmethod
    def open(cls, cfg: Config, local: Decoder | None, progress) -> RemoteDecoder:
        """Connect and check the server lists remote.model (ConfigError if not; with a fallback, a server that does
        not answer leaves the circuit open and the local model answers until a probe reaches it)."""
        link = Link(cfg.remote)
        try:
            if (down := link.check()) is not None and local is None:
                raise ConfigError(down)
        except ConfigError:
            link.close()
            raise
        if down is not None:
            progress(f"[remote] {down}; the local model answers until the server does")
            link.failed(down, down=True)
        progress(f"[remote] {cfg.remote.kind} server {cfg.remote.base_url}, model {cfg.remote.model}, "
                 f"{cfg.remote.max_concurrent} at once, fallback {cfg.remote.fallback or 'none'}")
        return cls(cfg, link, local)

    def kind_capabilities(self) -> Capabilities:
        return Capabilities(name=f"remote {self.cfg.remote.kind}", drafters=DRAFTERS, k_values=tuple(range(1, 17)),
                            k_remedy="send a k from 1 to 16", max_context=UNLIMITED, max_input=UNLIMITED,
                            vocab_size=UNLIMITED, eos_ids=(), guided=self.kind.guided, sampling=self.kind.sampling,
                            forced_drafts=False, tools=self.kind.tools, renders=True)

    # -- the request the server gets -------------------------------------------------------------
    def body(self, prepared: Prepared) -> dict[str, Any]:
        """The create() arguments of a prepared request (RequestError for what this kind cannot carry)."""
        request, params, kind, names = prepared.request, prepared.sampling, self.kind, self.kind.fields
        body: dict[str, Any] = {"model": self.cfg.remote.model, "max_tokens": prepared.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p, "stream": True,
                                "stream_options": {"include_usage": True}}
        extra: dict[str, Any] = {}
        if self.cfg.remote.kind == "spec_edge":  # its own fields, only where the request set them
            extra.update({name: value for name, value in (("drafter", request.drafter), ("k", request.k))
                          if value is not None} | ({} if request.speculate else {"speculate": False}))
        elif request.drafter is not None or request.k is not None:
            raise RequestError(f"drafter / k choose spec_edge's own speculation; a {self.cfg.remote.kind} server "
                               "speculates as it was started: send them unset")
        if params.top_k:
            if not kind.top_k:
                raise RequestError(f"top_k: an {self.cfg.remote.kind} server has no such option: send top_k unset or 0")
            extra["top_k"] = params.top_k
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(params, name) != off:
                body[name] = getattr(params, name)
        for name, value, off in (("min_p", params.min_p, 0.0), ("repetition_penalty", params.repetition_penalty, 1.0),
                                 ("ignore_eos", request.ignore_eos, False)):
            if value != off:
                extra[names.get(name, name)] = value
        if prepared.seed is not None:
            body["seed"] = prepared.seed
        if request.stop:
            body["stop"] = list(request.stop)
        if params.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
        if request.json_schema:
            schema = json.loads(request.json_schema)
            body["response_format"] = ({"type": "json_object", "schema": schema} if names.get("json_schema") else
                                       {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        elif request.regex or request.grammar:
            which = "regex" if request.regex else "gbnf" if "::=" in request.grammar else "lark"
            extra[names[which]] = request.regex or request.grammar
        if request.tools:
            body["tools"] = tool_specs(request.tools)
            choice = request.tool_choice or "auto"
            body["tool_choice"] = choice if choice in ("auto", "none", "required") else {
                "type": "function", "function": {"name": choice}}
            body["parallel_tool_calls"] = request.parallel_tool_calls
        if extra:
            body["extra_body"] = extra
        if not request.chat:
            return body | {"prompt": prepared.text}
        return body | {"messages": [self._message(m) for m in prepared.messages]}

    @staticmethod
    def _message(m) -> dict[str, Any]:
        out: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            out["tool_calls"] = openai_calls(m.tool_calls)
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        return out

    async def _stream(self, call: _Call, body: dict[str, Any]) -> GenerateResult:
        """Run one request on the server (retried on a link failure before its first piece, never after)."""
        remote, chat = self.cfg.remote, "messages" in body
        create = self.link.client.chat.completions.create if chat else self.link.client.completions.create
        for attempt in range(remote.retries + 1):
            call.pieces.clear()
            calls: dict[int, list[str]] = {}
            finish, ours, usage, first, reason = "", None, None, 0.0, None
            try:
                stream = await asyncio.wait_for(create(**body), remote.first_token_timeout_s)
                try:
                    chunks = aiter(stream)
                    while (reason := call.sink.cancel_reason()) is None:  # (else: the stream closes below)
                        wait = remote.timeout_s if call.pieces or calls else remote.first_token_timeout_s
                        try:
                            chunk = await asyncio.wait_for(anext(chunks), wait)
                        except StopAsyncIteration:
                            break
                        usage = chunk.usage or usage
                        ours = (chunk.model_extra or {}).get("spec_edge", ours)
                        for choice in chunk.choices:
                            finish = choice.finish_reason or finish
                            text = choice.delta.content if chat else choice.text
                            for tc in (choice.delta.tool_calls or []) if chat else []:
                                entry = calls.setdefault(tc.index, ["", "", ""])
                                entry[0] = tc.id or entry[0]
                                if tc.function is not None:
                                    entry[1] += tc.function.name or ""
                                    entry[2] += tc.function.arguments or ""
                            if text:
                                first = first or time.monotonic() - call.started
                                call.pieces.append(text)
                                call.sink.on_text(text, len(call.pieces))
                finally:
                    await stream.close()
            except (openai.BadRequestError, openai.UnprocessableEntityError) as err:  # the server refused it
                raise RequestError(f"the {remote.kind} server refused the request: {_reason(err)}") from None
            except Exception as err:  # noqa: BLE001 - the link failed (a reset mid-stream is the transport's own error)
                reason = f"{type(err).__name__}: {_reason(err)}"
                if call.pieces:  # the client has part of the answer: never restarted
                    self.link.failed(reason)
                    raise Unavailable(f"remote unavailable: the link to {remote.base_url} broke after "
                                            f"{len(call.pieces)} streamed pieces ({reason}); not restarted") from None
                if attempt == remote.retries:
                    self.link.failed(reason)
                    raise Unavailable(f"remote unavailable: {remote.base_url} ({reason})") from None
                continue
            if reason is not None:
                return self._result(call, reason, None, None, [], first)
            self.link.succeeded(first)
            return self._result(call, FINISH.get(finish, "eos"), ours, usage,
                                [ToolCall(c[0], c[1], c[2]) for _, c in sorted(calls.items())], first)
        raise AssertionError("unreachable")

    def _result(self, call: _Call, finish: str, ours: dict | None, usage, tool_calls: list[ToolCall],
                first: float) -> GenerateResult:
        """The GenerateResult of a remote request (spec_edge servers: their finish reason, token ids, stats)."""
        stats = Stats(served_by="remote", new_tokens=usage.completion_tokens if usage else len(call.pieces),
                      prompt_tokens=usage.prompt_tokens if usage else 0, time_to_first_token_s=first,
                      total_time_s=time.monotonic() - call.started)
        ids: list[int] = []
        if ours:
            finish, ids = ours.get("finish_reason", finish), list(ours.get("token_ids", []))
            names = {"drafter", "k", "drafted", "accepted", "verify_calls", "step_calls", "prefill_time_s"}
            for name, value in (ours.get("stats") or {}).items():
                if name in names:
                    setattr(stats, name, value)
        return GenerateResult(text="".join(call.pieces), token_ids=ids, finish_reason=finish, stats=stats,
                              prompt_tokens=stats.prompt_tokens, tool_calls=tool_calls)

    # -- serving.Decoder -----------------------------------------------------------------------
    @property
    def occupied(self) -> int:
        return len(self._calls) + len(self._local_queue) + (self.local.occupied if self.local else 0)

    def add(self, prepared: Prepared, sink: Sink, waiting: int) -> None:
        if self.link.open:
            self._unavailable(prepared, sink, f"the circuit to {self.cfg.remote.base_url} is open "
                                              f"({self.link.last_error})")
            return
        call = _Call(prepared, sink, time.monotonic())
        body = self.body(prepared)  # (RequestError: refused, nothing sent)
        call.future = self.link.run(self._stream(call, body))
        call.future.add_done_callback(lambda _: self._ended.set())
        self._calls.append(call)

    def _unavailable(self, prepared: Prepared, sink: Sink, why: str) -> None:
        """The server cannot take a request that has not streamed: the local model's, else answered unavailable."""
        if self.local is None:
            sink.failed(Unavailable(f"remote unavailable: {why}"))
        else:
            self._local_queue.append((prepared, sink, why))

    def iterate(self, waiting: int) -> None:
        for call in list(self._calls):
            if (reason := call.sink.cancel_reason()) is not None and not call.future.done():
                call.future.cancel()  # the stream closes: the server sees its client gone
                self._calls.remove(call)
                call.sink.done(GenerateResult(text="".join(call.pieces), token_ids=[], finish_reason=reason,
                                              stats=Stats(served_by="remote", new_tokens=len(call.pieces))))
            elif call.future.done():
                self._calls.remove(call)
                try:
                    result = call.future.result()
                except Unavailable as err:
                    if call.pieces or self.local is None:
                        call.sink.failed(err)
                    else:
                        self._unavailable(call.prepared, call.sink, str(err).removeprefix("remote unavailable: "))
                except Exception as err:  # noqa: BLE001 - refused (RequestError) or failed: its answer
                    call.sink.failed(err)
                else:
                    call.sink.done(result)
        local = self.local
        while local is not None and self._local_queue and local.occupied < local.capacity:
            prepared, sink, why = self._local_queue.popleft()
            if (reason := sink.cancel_reason()) is not None:
                sink.done(GenerateResult(text="", token_ids=[], finish_reason=reason, stats=Stats(served_by="local")))
            else:
                try:
                    local.add(prepared, _Local(sink, why), waiting + len(self._local_queue))
                except Exception as err:  # noqa: BLE001 - refused (RequestError) or failed: its answer
                    sink.failed(err)
        if local is not None and local.occupied:
            local.iterate(waiting + len(self._local_queue))
        elif self._calls:
            self._ended.wait(POLL_S)
            self._ended.clear()

    def clear(self) -> None:
        for call in self._calls:
            call.future.cancel()
        self._calls.clear()
        self._local_queue.clear()
        if self.local is not None:
            self.local.clear()

    def warm(self, prefix_ids: list[int]) -> None:
        """The fallback's cache (the server keeps its own; without a fallback the front hands no prefix)."""
        if self.local is not None:
            self.local.warm(prefix_ids)

    def info(self) -> dict:
        return {"backend": "remote", "model": self.cfg.remote.model, "max_concurrent": self.capacity,
                "remote": self.link.state()} | (
            {"fallback_model": self.local.info().get("model", "")} if self.local is not None else {})

    def close(self) -> None:
        self.clear()
        self.link.close()
        if self.local is not None:
            self.local.close()


class _Local:
    """The sink of a request the local model answers for the server: its result says so."""

    def __init__(self, sink: Sink, why: str):
        self.sink, self.why = sink, why

    def on_text(self, delta: str, n_tokens: int) -> None:
        self.sink.on_text(delta, n_tokens)

    def cancel_reason(self) -> str | None:
        return self.sink.cancel_reason()

    def done(self, result: GenerateResult) -> None:
        result.stats.served_by = "local"
        result.message = "; ".join(filter(None, [f"answered by the local model: {self.why}", result.message]))
        self.sink.done(result)

    def failed(self, err: Exception) -> None:
        self.sink.failed(err)


def _reason(err: Exception) -> str:
    """The server's own words for an error (its JSON error message where it sent one)."""
    body = err.body if isinstance(err, openai.APIStatusError) else None
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error", {}).get("message") or body)
    return str(err) or type(err).__name__
