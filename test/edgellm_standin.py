"""A stand-in for Edge-LLM's `_edgellm_runtime`, generated from the committed snapshot of the real binary's
surface (fixtures/edgellm_api.json, written by edgellm_native.py and checked equal to the live binary by
test_edgellm_api.py): every class, method, property and enum value the snapshot lists exists here and
nothing else; a call is checked against the real pybind11 signatures (positional count, keyword names,
required parameters) and raises TypeError as the binding would; a read-only property cannot be set.

Behaviour is scripted per test: Script.reply(call) -> Reply (the token ids to stream, the finish reason,
the speculative counters one request adds; for RequestEngine a request that retires without reaching the
runtime, or a producer deaf to cancel), Script.count(text) -> the runtime's token count of a prompt,
Script.decode(ids) -> a chunk's text. RequestHandle.ready() turns true when the request is terminal, as the binding
documents it. Every LLMRuntime / RequestEngine made is recorded on the script (constructor args, requests handled).

What the stand-in does as Edge-LLM does, each from Edge-LLM's own code (a behaviour nothing there states is marked
ASSUMED):
  sampling    a request is sampled when sampling.cpp shouldUseNonGreedySampling(temperature, topK, topP) says so
              (recorded per call as call._sampled), else it is the argmax; a sampled request must have topK > 0 or
              topP < 1, else it fails with SamplingParams' own message (cpp/sampler/sampling.h, "Either topK or topP
              must be set"; the string is in the 0.11.0 binary). ASSUMED: the throw reaches Python as ValueError
              from handle_request (pybind11 translates std::invalid_argument so) and ends a RequestEngine request
              with a terminal ERROR chunk.
  speculation a sampled request on an EAGLE-3 LLMRuntime runs on the vanilla decoder (the binary's log line "Decoder
              fallback: reason=non_greedy_eagle_unsupported, selected=vanilla"), as does one with
              disable_spec_decode and every RequestEngine request: it adds nothing to the SpecDecode counters
              (call._decoder: "eagle3" or "vanilla"). The counters cover a request once handle_request has returned
              (tensorrt_edgellm/scripts/sweep_eagle3_configs.py _run_one reads them right after it).
  streaming   as the wheel's own consumer reads a StreamChannel (experimental/server/runtime/engine.py
              LLM.generate_stream): a chunk carries token_ids, its decoded text (chunk.text), prompt_token_count
              (>= 0 where known, -1 elsewhere), finished, reason, logprobs; the last chunk is finished, its reason the
              FinishReason, and it may carry ids of its own (the consumer keeps a terminal chunk's ids and text); the
              producer pushes that chunk before the channel reads is_finished() (the comment in generate_stream's
              finally); a request that ended in ERROR still delivers a terminal chunk (generate_stream's closing
              comment); a RequestEngine request that retires without reaching the runtime turns its handle ready()
              with its channel silent (generate_stream: "the request retired without ever reaching the runtime").
              ASSUMED (nothing in Edge-LLM's Python states it): a chunk holds Reply.chunk tokens (the channel's
              stream interval, StreamChannel.set_stream_interval, default unknown; 1 here unless scripted), the
              first chunk carries prompt_token_count, a cancel ends the production with a terminal CANCELLED chunk
              (the consumer itself stops at is_cancelled() without waiting for one), and chunk.text is the chunk's
              ids decoded on their own.
images      load_image_from_bytes(data) decodes a JPEG / PNG file to an ImageData whose read-only width / height /
              channels are the picture's (the binding's "Load image from bytes"; the binary's message for bytes it
              cannot decode, "Failed to load image from memory: ", raised as RuntimeError: ASSUMED how it reaches
              Python); the decoded pixels ride on it as _pixels for tests. A request's Request.image_buffers is
              recorded as sent (script.calls).
visual      VisualBuilder(onnx_dir, engine_dir, config).build() writes what cpp/builder/visualBuilder.cpp
              VisualBuilder::build does: engine_dir/visual.engine (empty here) and onnx_dir's config.json with
              builder_config (copyConfig: ASSUMED to hold the three VisualBuilderConfig fields, the keys the wheel's
              server reads back, experimental/server/runtime/engine.py _video_frame_limits); each build is recorded
              on the script (script.visual_builds: onnx_dir, engine_dir, the config's fields).
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
    chunk: int = 1                           # token ids per non-final chunk (ASSUMED: the stream interval)
    retire: bool = False                     # RequestEngine: terminal (ready) without a chunk on its channel
    deaf: bool = False                       # a cancel ends the production with no final chunk, never terminal


@dataclass
class Script:
    reply: object = None                     # (call) -> Reply
    count: object = None                     # (text) -> int
    decode: object = None                    # (ids) -> str: a chunk's text ("" when unset)
    runtimes: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    pause: threading.Event | None = None     # set: handle_request waits on it before each token
    visual_builds: list = field(default_factory=list)


def non_greedy(temperature: float, top_k: int, top_p: float) -> bool:
    """cpp/sampler/sampling.cpp shouldUseNonGreedySampling, as Edge-LLM's decoders call it per request."""
    if top_k == 1:
        return False
    return top_k > 1 or top_p < 1.0 - 1e-6 or (temperature > 1e-3 and abs(temperature - 1.0) > 1e-3)


def sampling_error(temperature: float, top_k: int, top_p: float) -> str:
    """cpp/sampler/sampling.h SamplingParams::SamplingParams: its std::invalid_argument message, "" when valid."""
    if not (top_k > 0 or top_p < 1.0):
        return "Either topK or topP must be set"
    if temperature < 0:
        return "Temperature must be greater than 0.0f"
    return ""


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

    def push(channel, tokens, finished, reason, prompt_tokens=-1):
        chunk = mod.StreamChunk()
        text = script.decode(list(tokens)) if script.decode is not None and tokens else ""
        set_internal(chunk, token_ids=list(tokens), text=text, finished=finished, reason=reason,
                     prompt_token_count=prompt_tokens, logprobs=[])
        channel._queue.put(chunk)
        if finished:  # after the chunk is in the channel (engine.py generate_stream)
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

    def serve(runtime, call, reply=None, batched=False):
        script.calls.append(call)
        reply = reply or script.reply(call)
        sampled = non_greedy(call.temperature, call.top_k, call.top_p)
        eagle = "draft_top_k" in runtime._kwargs and not batched and not call.disable_spec_decode and not sampled
        set_internal(call, _sampled=sampled, _decoder="eagle3" if eagle else "vanilla")
        channel = call.stream_channels[0]
        problem = sampling_error(call.temperature, call.top_k, call.top_p) if sampled else ""
        if problem and batched:  # ASSUMED: the engine ends such a request with a terminal ERROR chunk
            push(channel, [], True, mod.FinishReason.ERROR)
            return reply
        if problem:
            raise ValueError(problem)
        if reply.fail:
            raise RuntimeError(reply.fail)
        tokens, first = list(reply.tokens), True
        while True:
            if script.pause is not None:
                script.pause.wait()
            if channel._cancelled:
                if not reply.deaf:
                    push(channel, [], True, mod.FinishReason.CANCELLED)
                return reply
            piece, tokens = tokens[:reply.chunk], tokens[reply.chunk:]
            prompt = script.count(call.requests[0].messages[0].contents[0].content) if first and script.count else -1
            if not tokens:  # the last ids ride on the terminal chunk
                push(channel, piece, True, getattr(mod.FinishReason, reply.reason), prompt)
                break
            push(channel, piece, False, mod.FinishReason.NOT_FINISHED, prompt)
            first = False
        set_internal(runtime._prefill, reused_tokens=runtime._prefill.reused_tokens + reply.reused)
        if eagle:
            spec = runtime._spec
            set_internal(spec, total_iterations=spec.total_iterations + reply.spec[0],
                         total_proposed_draft_tokens=spec.total_proposed_draft_tokens + reply.spec[1],
                         total_accepted_draft_tokens=spec.total_accepted_draft_tokens + reply.spec[2])
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
                serve(self, call, reply, batched=True)
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
        self.image_buffers = []

    def load_image(data):
        import io

        import numpy as np
        from PIL import Image

        try:
            with Image.open(io.BytesIO(bytes(data))) as file:
                pixels = np.asarray(file.convert("RGB"))
        except Exception as err:
            raise RuntimeError(f"Failed to load image from memory: {err}") from None
        image = object.__new__(mod.ImageData)
        for prop in SURFACE["ImageData"]["members"]:
            if SURFACE["ImageData"]["members"][prop]["kind"] == "property":
                object.__setattr__(image, prop, None)
        set_internal(image, height=pixels.shape[0], width=pixels.shape[1], channels=3, frames=1, is_video=False,
                     do_resize=True, _pixels=pixels)
        return image

    def content_init(self, type="", content=""):
        self.type, self.content = type, content

    def visual_builder_init(self, onnx_dir, engine_dir, config):
        set_internal(self, _onnx=str(onnx_dir), _engine=str(engine_dir), _config=config)

    def visual_build(self):
        from pathlib import Path

        fields = {name: getattr(self._config, name) for name in ("min_image_tokens", "max_image_tokens",
                                                                  "max_image_tokens_per_image")}
        script.visual_builds.append((self._onnx, self._engine, fields))
        engine = Path(self._engine)
        engine.mkdir(parents=True, exist_ok=True)
        (engine / "visual.engine").write_bytes(b"")
        exported = json.loads((Path(self._onnx) / "config.json").read_text())
        (engine / "config.json").write_text(json.dumps({**exported, "builder_config": fields}))
        return True

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
        "VisualBuilder": {"__init__": visual_builder_init, "build": visual_build},
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

    functions = {"create_text_message": message, "load_image_from_bytes": load_image,
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
