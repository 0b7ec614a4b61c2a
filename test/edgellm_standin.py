"""A stand-in for Edge-LLM's `_edgellm_runtime`, generated from the committed snapshot of the real binary's
surface (fixtures/edgellm_api.json, written by edgellm_native.py and checked equal to the live binary by
test_edgellm_api.py): every class, method, property and enum value the snapshot lists exists here and
nothing else; a call is checked against the real pybind11 signatures (positional count, keyword names,
required parameters) and raises TypeError as the binding would; a read-only property cannot be set.

Behaviour is scripted per test: Script.reply(call) -> Reply (the token ids to stream, the finish reason,
the speculative counters one request adds; for RequestEngine a request that retires without reaching the
runtime, or a producer deaf to cancel), Script.count(text) -> the runtime's token count of a prompt.
RequestHandle.ready() turns true when the request is terminal, as the binding documents it.
Every LLMRuntime / RequestEngine made is recorded on the script (constructor args, requests handled).
validate_guided_decoding_params refuses a json_schema guide that names a keyword the binary's list says XGrammar
accepts but does not enforce (UNENFORCED_KEYWORDS, its message UNENFORCED: both read from the binary's strings by
test_edgellm_api.py), unless the script sets validate. The tool-call surface (LLMGenerationRequest.tools /
tool_choice / parallel_tool_calls, Message.tool_calls / tool_call_id, ToolDefinition, ToolChoice, MessageToolCall)
is in the snapshot like every other name, so the stand-in has exactly the binary's tool fields.
"""
from __future__ import annotations

import json
import queue
import threading
import types
from dataclasses import dataclass, field

from edgellm_native import SNAPSHOT, accepts, callable_signatures

SURFACE = json.loads(SNAPSHOT.read_text())["api"]
# cpp/runtime/decoding/guidedDecoder.cpp (kUnsupportedSchemaKeywords, validateGuidedDecodingParams)
UNENFORCED_KEYWORDS = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "patternProperties")
UNENFORCED = ("guided_decoding.json_schema uses '%s', which XGrammar accepts but does not enforce; the generated "
              "output would not be guaranteed to match the schema")


def validate(params) -> tuple[bool, str]:
    """validate_guided_decoding_params as the binary's list reads (a json_schema guide naming an unenforced keyword)."""
    if params.type.name == "JSON_SCHEMA":
        for keyword in UNENFORCED_KEYWORDS:
            if f'"{keyword}"' in params.guide:
                return False, UNENFORCED % keyword
    return True, ""


@dataclass
class Reply:
    tokens: list[int]
    reason: str = "END_ID"                   # a FinishReason name
    spec: tuple[int, int, int] = (0, 0, 0)   # (iterations, proposed, accepted) this request adds
    reused: int = 0                          # prefill tokens reused from the context cache
    fail: str = ""                           # handle_request raises RuntimeError(fail)
    retire: bool = False                     # RequestEngine: terminal (ready) without a chunk on its channel
    deaf: bool = False                       # a cancel ends the production with no final chunk, never terminal


@dataclass
class Script:
    reply: object = None                     # (call) -> Reply
    count: object = None                     # (text) -> int
    runtimes: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    pause: threading.Event | None = None     # set: handle_request waits on it before each token


def _check(owner: str, member: str | None, args: tuple, kwargs: dict) -> None:
    overloads = callable_signatures(SURFACE, owner, member)
    where = f"{owner}.{member}" if member else owner
    if overloads is None:
        raise TypeError(f"{where}: no constructor defined")
    if not any(accepts(o, len(args), set(kwargs)) for o in overloads):
        raise TypeError(f"{where}(): incompatible function arguments ({len(args)} positional, "
                        f"keywords {sorted(kwargs)}); supported: {overloads}")


def build(script: Script) -> types.ModuleType:
    """A module with the snapshot's names, behaving as `script` says."""
    mod = types.ModuleType("tensorrt_edgellm._edgellm_runtime")
    enums = {name: entry["enum"] for name, entry in SURFACE.items() if entry.get("enum")}

    class EnumValue:
        def __init__(self, cls_name, name, value):
            self._cls, self.name, self.value = cls_name, name, value

        def __repr__(self):
            return f"<{self._cls}.{self.name}: {self.value}>"

        def __int__(self):
            return self.value

    def make_class(name: str, entry: dict, impl: dict):
        members = entry["members"]
        props = {m: v for m, v in members.items() if v["kind"] == "property"}

        def __init__(self, *args, **kwargs):
            _check(name, "__init__", args, kwargs)
            for prop in props:
                object.__setattr__(self, prop, None)
            if "__init__" in impl:
                impl["__init__"](self, *args, **kwargs)

        def __setattr__(self, key, value):
            if key.startswith("_"):
                return object.__setattr__(self, key, value)
            if key not in props:
                raise AttributeError(f"'{name}' object has no attribute '{key}'")
            if not props[key]["settable"]:
                raise AttributeError(f"property '{key}' of '{name}' object has no setter")
            object.__setattr__(self, key, value)

        body = {"__init__": __init__, "__setattr__": __setattr__}
        for member, spec in members.items():
            if spec["kind"] in ("method", "staticmethod") and member != "__init__":
                def method(*args, _member=member, _static=spec["kind"] == "staticmethod", **kwargs):
                    self_args = args if _static else args[1:]
                    _check(name, _member, self_args, kwargs)
                    if _member not in impl:
                        raise NotImplementedError(f"the stand-in scripts no {name}.{_member}")
                    return impl[_member](*args, **kwargs)
                body[member] = staticmethod(method) if spec["kind"] == "staticmethod" else method
        return type(name, (), body)

    def set_internal(obj, **values):
        for key, value in values.items():
            object.__setattr__(obj, key, value)

    # -- behaviour --------------------------------------------------------------------------------
    def channel_init(self):
        set_internal(self, _queue=queue.Queue(), _finished=False, _cancelled=False)

    def push(channel, tokens, finished, reason):
        chunk = mod.StreamChunk()
        set_internal(chunk, token_ids=list(tokens), text="", finished=finished, reason=reason, prompt_token_count=-1,
                     logprobs=[])
        channel._queue.put(chunk)
        if finished:
            channel._finished = True

    def wait_pop(self, timeout_ms):
        try:
            return self._queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None

    def try_pop(self):
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def create():
        channel = object.__new__(mod.StreamChannel)
        channel_init(channel)
        return channel

    def cancel_channel(self):
        self._cancelled = True

    def serve(runtime, call, reply=None):
        script.calls.append(call)
        reply = reply or script.reply(call)
        if reply.fail:
            raise RuntimeError(reply.fail)
        channel = call.stream_channels[0]
        for token in reply.tokens:
            if script.pause is not None:
                script.pause.wait()
            if channel._cancelled:
                if not reply.deaf:
                    push(channel, [], True, mod.FinishReason.CANCELLED)
                return reply
            push(channel, [token], False, mod.FinishReason.NOT_FINISHED)
        push(channel, [], True, getattr(mod.FinishReason, reply.reason))
        spec = runtime._spec
        set_internal(spec, total_iterations=spec.total_iterations + reply.spec[0],
                     total_proposed_draft_tokens=spec.total_proposed_draft_tokens + reply.spec[1],
                     total_accepted_draft_tokens=spec.total_accepted_draft_tokens + reply.spec[2])
        set_internal(runtime._prefill, reused_tokens=runtime._prefill.reused_tokens + reply.reused)
        return reply

    def runtime_init(self, *args, **kwargs):
        spec, prefill = object.__new__(mod.SpecDecodeGenerationMetrics), object.__new__(mod.LLMPrefillMetrics)
        set_internal(spec, total_iterations=0, total_proposed_draft_tokens=0, total_accepted_draft_tokens=0)
        set_internal(prefill, reused_tokens=0, computed_tokens=0)
        set_internal(self, _spec=spec, _prefill=prefill, _args=args, _kwargs=kwargs)
        script.runtimes.append(self)

    def count(self, call):
        return [script.count(m.contents[0].content) for item in call.requests for m in item.messages[:1]]

    def submit(self, call):
        handle = object.__new__(mod.RequestHandle)
        set_internal(handle, _channel=call.stream_channels[0], _ready=False)

        def run():
            reply = script.reply(call)
            if reply.retire:
                script.calls.append(call)
            else:
                serve(self, call, reply)
                if reply.deaf and handle._channel._cancelled:
                    return  # never terminal
            set_internal(handle, _ready=True)
        threading.Thread(target=run, daemon=True).start()
        return handle

    def message(role, text):
        msg = mod.Message()
        msg.role, msg.contents = role, [mod.MessageContent("text", text)]
        return msg

    def guided_init(self, type=None, guide=""):
        self.type, self.guide = type, guide

    def request_init(self, messages=()):
        self.messages, self.stop_strings, self.guided_decoding = list(messages), [], None

    def content_init(self, type="", content=""):
        self.type, self.content = type, content

    impls = {
        "StreamChannel": {"create": create, "wait_pop": wait_pop, "try_pop": try_pop, "cancel": cancel_channel,
                          "is_finished": lambda self: self._finished, "is_cancelled": lambda self: self._cancelled},
        "LLMRuntime": {"__init__": runtime_init, "handle_request": serve, "count_prompt_tokens": count,
                       "capture_decoding_cuda_graph": lambda self: True,
                       "get_spec_decode_generation_metrics": lambda self: self._spec,
                       "get_prefill_metrics": lambda self: self._prefill},
        "RequestEngine": {"__init__": runtime_init, "submit": submit, "count_prompt_tokens": count,
                          "shutdown": lambda self, mode=None: set_internal(self, _shutdown=mode)},
        "RequestHandle": {"stream": lambda self: self._channel, "cancel": lambda self: cancel_channel(self._channel),
                          "ready": lambda self: self._ready},
        "GuidedDecodingParams": {"__init__": guided_init},
        "Request": {"__init__": request_init},
        "MessageContent": {"__init__": content_init},
    }
    for name, entry in SURFACE.items():
        if entry["kind"] != "class":
            continue
        if name == "SubmitError":
            setattr(mod, name, type(name, (Exception,), {}))
            continue
        cls = make_class(name, entry, impls.get(name, {}))
        for value_name, value in enums.get(name, {}).items():
            setattr(cls, value_name, EnumValue(name, value_name, value))
        setattr(mod, name, cls)

    functions = {"create_text_message": message,
                 "validate_guided_decoding_params": lambda params: getattr(script, "validate", validate)(params)}
    for name, entry in SURFACE.items():
        if entry["kind"] == "function":
            def function(*args, _name=name, **kwargs):
                _check(_name, None, args, kwargs)
                if _name not in functions:
                    raise NotImplementedError(f"the stand-in scripts no {_name}")
                return functions[_name](*args, **kwargs)
            setattr(mod, name, function)
    return mod
