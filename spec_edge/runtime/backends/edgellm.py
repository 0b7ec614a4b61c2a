"""runtime.backend tensorrt: a whole request served by NVIDIA TensorRT Edge-LLM (`tensorrt-edgellm`, pinned
EDGELLM_VERSION), beside the ONNX Runtime engine (engine.py). EdgeLLMEngine is a serving.Decoder: the scheduler (every
door) and the CLI drive it exactly as they drive engine.Engine.

Two Edge-LLM objects, picked by graphs.batch_slots, are the EdgeLLMEngine's mode (a strategy object): _Serial
(1: LLMRuntime, drafting EAGLE-3 or not, one request at a time) and _Batched (B > 1: RequestEngine, no drafting).

What maps to what (docs/tensorrt.md, "Serving: the runtime adapter"):
  prompt / messages / system prompt -> rendered by OUR chat template (front.Front, the CPU path's) and
      sent as one pre-formatted text message with apply_chat_template=False (Edge-LLM concatenates the text of
      such messages as it is); at load, count_prompt_tokens of a probe conversation must equal our tokenizer's
      count, else the engine refuses to start (the two tokenizers disagree).
  temperature / top_k / top_p -> sampler_fields (Edge-LLM's sampler rule: "off" is top_p TOP_P_OFF, temperature 0 is
      top_k=1, the argmax); seed (sampling_seed), max_new_tokens (max_generate_length). A sampled request (non_greedy)
      runs without speculation (disable_spec_decode; its speculation_off_reason says so): Edge-LLM's EAGLE-3 decoder
      is greedy only.
  logit_bias -> Request.logit_bias (id -> bias). min_p, the repetition / presence / frequency penalties,
      ignore_eos and logprobs are refused by the front (its Capabilities), naming runtime.backend: onnxruntime (Edge-LLM's request has no
      such sampling option; its num_logprobs is not mapped: its numbers are not checked against ours).
  stop strings -> Request.stop_strings (Edge-LLM stops); the text and ids are cut at the stop string here, as on
      the CPU path (StreamDecoder), so both answer the same.
  json_schema / regex -> GuidedDecodingParams(JSON_SCHEMA / REGEX); a GBNF grammar (`::=` rules) -> EBNF (XGrammar
      reads GBNF-style EBNF); the front refuses a Lark grammar, naming runtime.backend: onnxruntime.
  tools / tool_choice / parallel_tool_calls, assistant tool_calls and tool turns -> rendered into the prompt by OUR tool
      format (runtime/tool_format.py, as on the CPU path: Hermes blocks, Llama 3.1/3.2 JSON, Mistral), and the call
      syntax constrained by the format's XGrammar structural tag, its Lark grammar's language (tool_guide:
      GuidedDecodingParams(STRUCTURAL_TAG), each tool's arguments its JSON Schema); the output is
      split into text and ToolCalls (ids ours, tool_format.new_call_id) by the same format, finish_reason tool_calls.
      Edge-LLM's own tool fields (LLMGenerationRequest.tools / tool_choice / parallel_tool_calls, Message.tool_calls /
      tool_call_id) are left unset: they only feed its chat template, which apply_chat_template=False bypasses, and
      its runtime neither constrains nor parses calls (docs/tensorrt.md, "Tool calls on Edge-LLM"). A schema keyword
      XGrammar accepts but does not enforce is refused, naming runtime.backend: onnxruntime.
  images (Prepared.images, (H, W, 3) uint8 RGB in IMAGE_MARKER order; a profile with graphs.max_image_tokens, its
      visual engine built by `spec-edge build`) -> each one PNG-encoded into load_image_from_bytes, the ImageData
      list Request.image_buffers in marker order, each IMAGE_MARKER of the rendered text replaced by the Qwen-VL
      image span <|vision_start|><|image_pad|><|vision_end|> (the tokens of the visual engine's config.json ids):
      the runtime's QwenViTRunner::textPreprocess gives the Nth <|image_pad|> the Nth image buffer's tokens (the
      wheel's server builds the same list the same way: experimental/server/runtime/engine.py _load_image_buffers,
      do_resize on); the bundle root holding visual/ is LLMRuntime / RequestEngine's multimodal_engine_dir. Such a
      request bypasses the context cache (docs/tensorrt.md, "Images: Edge-LLM's VLM pipeline").
  streaming -> the request's StreamChannel: its token ids go through our StreamDecoder into on_text.
  cancel (service timeout, action cancel, shutdown) -> polled while waiting on the channel; StreamChannel.cancel()
      (LLMRuntime) or RequestHandle.cancel() (RequestEngine); the finish reason is cancel()'s answer. A batched
      request ends within CANCEL_GRACE_S of its cancel even when no final chunk comes, and a handle that turns
      ready (terminal) with a silent channel ends the request with an error (as Edge-LLM's own server does).
  finish reasons: END_ID eos, STOP_WORDS stop, LENGTH length, CANCELLED the cancel reason, ERROR error.
  serve.reuse_prefix -> the runtime's context cache (ContextCacheConfig.enabled; per request USE_CACHE or BYPASS);
      warm() prefills the system prompt's chat prefix once through it.
  speculate_k_by_load -> per request only 0 (disable_spec_decode) or speculative.k: config.validate refuses others.
Stats: what Edge-LLM reports, per request as the difference of its cumulative metrics around the request
(LLMRuntime is serialised, so the difference is this request's): verify_calls (SpecDecode total_iterations),
drafted, accepted, prompt_tokens_reused (prefill reused_tokens); time to first token and total time are measured
here. Acceptance per position, prefill / target / draft times are not reported by Edge-LLM: they stay empty / 0.

Every name this module calls on the native module is in EDGELLM_API (test_edgellm_api.py checks each against the
real binary, and that this table lists everything the source uses); EDGELLM_RECEIVERS says which Edge-LLM class
each expression holds. The native module comes from tensorrt_edgellm.runtime.load() (the wheel picks its payload
by the exact Jetson L4T / GPU); tests pass a stand-in generated from the real signatures.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from spec_edge import speculation_policy
from spec_edge.config import Config, ConfigError, speculative_k
from spec_edge import edgellm_layout
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.edgellm_visual import VisualEngine, multimodal_dir, png, visual_engine
from spec_edge.runtime.front import Capabilities, Prepared
from spec_edge.runtime.serving import Sink
from spec_edge.runtime.requests import IMAGE_MARKER, GenerateResult, RequestError
from spec_edge.runtime.stats import Stats
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer
from spec_edge.runtime.tool_format import Answer, ToolFormat

EDGELLM_VERSION = edgellm_layout.EDGELLM_VERSION
EDGELLM_DRAFTERS = ("none", "eagle3")  # config.BACKEND_DRAFTERS["tensorrt"]
# Edge-LLM class (or module function) -> the members this module uses on it (enum classes: the values)
EDGELLM_API: dict[str, tuple[str, ...]] = {
    "LLMRuntime": ("__init__", "handle_request", "capture_decoding_cuda_graph", "count_prompt_tokens",
                   "get_spec_decode_generation_metrics", "get_prefill_metrics"),
    "RequestEngine": ("__init__", "submit", "shutdown", "count_prompt_tokens"),
    "RequestHandle": ("stream", "cancel", "ready"),
    "ContextCacheConfig": ("__init__", "enabled"),
    "LLMGenerationRequest": ("__init__", "requests", "apply_chat_template", "add_generation_prompt", "temperature",
                             "top_p", "top_k", "sampling_seed", "max_generate_length", "disable_spec_decode",
                             "skip_special_tokens", "stream_channels", "context_cache_lookup_policy",
                             "context_cache_commit_policy"),
    "Request": ("__init__", "stop_strings", "guided_decoding", "logit_bias", "image_buffers"),
    "GuidedDecodingParams": ("__init__",),
    "StreamChannel": ("create", "wait_pop", "try_pop", "is_finished", "cancel"),
    "StreamChunk": ("token_ids", "finished", "reason"),
    "SpecDecodeGenerationMetrics": ("total_iterations", "total_proposed_draft_tokens", "total_accepted_draft_tokens"),
    "LLMPrefillMetrics": ("reused_tokens",),
    "GuideType": ("JSON_SCHEMA", "REGEX", "EBNF", "STRUCTURAL_TAG"),
    "FinishReason": ("NOT_FINISHED", "END_ID", "LENGTH", "CANCELLED", "ERROR", "STOP_WORDS"),
    "ContextCacheLookupPolicy": ("USE_CACHE", "BYPASS"),
    "ContextCacheCommitPolicy": ("PREFILL_STATE_ONLY",),
    "ShutdownMode": ("CANCEL",),
    "SubmitError": (),
    "create_text_message": (),
    "load_image_from_bytes": (),
    "ImageData": ("do_resize",),
    "validate_guided_decoding_params": (),
}
# expression in this module's source -> the Edge-LLM class of the object it holds
EDGELLM_RECEIVERS = {"self.runtime": "LLMRuntime", "self.batcher": "RequestEngine", "handle": "RequestHandle",
                     "cache": "ContextCacheConfig", "call": "LLMGenerationRequest", "item": "Request",
                     "channel": "StreamChannel", "chunk": "StreamChunk", "counts": "SpecDecodeGenerationMetrics",
                     "prefill": "LLMPrefillMetrics", "image": "ImageData"}
POLL_MS = 20  # how long one wait on the stream channel blocks before cancel() is asked again
CANCEL_GRACE_S = 0.5  # a batched request ends this long after its cancel even without a final chunk
PROBE = (("system", "You are a robot."), ("user", "Say hi."))  # the tokenizer agreement check at load
# Edge-LLM's sampler (cpp/sampler/sampling.h SamplingParams::SamplingParams): a sampled step throws
# std::invalid_argument("Either topK or topP must be set") unless topK > 0 or topP < 1, so "no top-k, no top-p" has
# no value of its own there. TOP_P_OFF stands for it: the largest top_p that sampling.cpp shouldUseNonGreedySampling
# reads as set (topP < 1.0f - 1e-6f; float32(0.999998) = 0.99999797 < 0.99999899), so temperature 1.0 samples too.
# Its top-p cut (sampling.cu topPSampling: the smallest prefix of the sorted probabilities reaching top_p,
# renormalised) drops a tail of at most 2e-6 of the probability mass.
TOP_P_OFF = 0.999998
SAMPLED_OFF_REASON = ("sampling (temperature > 0, top_k != 1) on Edge-LLM runs without speculation: its EAGLE-3 "
                      "decoder is greedy only (the runtime falls back to its vanilla decoder, 'Decoder fallback: "
                      "reason=non_greedy_eagle_unsupported'); send temperature 0 to speculate")


def non_greedy(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether Edge-LLM samples a request sent with these fields (sampling.cpp shouldUseNonGreedySampling: top_k 1
    is the argmax; else top_k > 1, top_p < 1 - 1e-6, or a temperature neither ~0 nor ~1). Greedy otherwise."""
    if top_k == 1:
        return False
    return top_k > 1 or top_p < 1.0 - 1e-6 or (temperature > 1e-3 and abs(temperature - 1.0) > 1e-3)


def sampler_fields(params) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) for LLMGenerationRequest from a request's sampling values (runtime.sampling.
    SamplingParams: top_k 0 and top_p 1 mean off): greedy -> (1.0, 1, 1.0), the argmax; sampled -> the same values,
    except a top_p Edge-LLM would read as unset while top_k is off (1.0, "off", or above TOP_P_OFF): TOP_P_OFF, so
    SamplingParams accepts it and shouldUseNonGreedySampling samples at every temperature > 0."""
    if params.temperature == 0:
        return 1.0, 1, 1.0
    top_p = params.top_p if params.top_k > 0 else min(params.top_p, TOP_P_OFF)
    return params.temperature, params.top_k, top_p


@dataclass(frozen=True)
class EdgeLLMDirs:
    """The folders `spec-edge build` wrote for a profile (spec_edge/edgellm_layout.py): engine_dir (the engine, its
    config with builder_config, tokenizer and chat_template.jinja; with an EAGLE-3 head the base and draft engines
    side by side: Edge-LLM's LLMRuntime reads both from one folder) and draft_engine_dir (None without a head)."""
    engine_dir: Path
    draft_engine_dir: Path | None
    max_input_len: int         # longest prompt the engine takes (its builder_config)
    max_kv_cache_capacity: int  # prompt + answer tokens one sequence holds
    tree: edgellm_layout.EagleTree | None  # the EAGLE-3 drafting shape LLMRuntime is made with (None: no drafter)
    visual: VisualEngine | None = None  # graphs.max_image_tokens > 0: the visual engine (None: text only)


def edgellm_dirs(cfg: Config) -> EdgeLLMDirs:
    """The engine folders `spec-edge build` recorded for cfg's profile (spec_edge/edgellm_layout.py: a manifest of
    this tensorrt-edgellm version, profile and config, engines built) and the target engine's builder limits;
    BackendError naming the build command when anything is missing or stale. graphs.batch_slots > 1 serves the
    plain engine RequestEngine runs (batch_engine_dir)."""
    try:
        if cfg.graphs.batch_slots > 1:
            engine_dir, draft_dir = edgellm_layout.batch_engine_dir(cfg), None
        else:
            engine_dir, draft_dir = edgellm_layout.engine_dirs(cfg)
    except (edgellm_layout.ManifestError, ConfigError) as err:
        raise BackendError(str(err)) from None
    build = f"rebuild with `spec-edge build <profile yaml> --force` for profile '{cfg.runtime.profile}' on the device"
    if cfg.speculative.drafter == "eagle3" and cfg.graphs.batch_slots == 1 and draft_dir is None:
        raise BackendError(f"speculative.drafter eagle3 needs the EAGLE-3 draft engine and the build of profile "
                           f"'{cfg.runtime.profile}' has none: {build} with speculative.eagle3_head set")
    role = "base" if draft_dir is not None else "llm"
    try:
        limits = edgellm_layout.read_builder_config(engine_dir, role)
        max_input, capacity = int(limits["max_input_len"]), int(limits["max_kv_cache_capacity"])
        tree = None
        if draft_dir is not None:
            tree = edgellm_layout.eagle3_tree(cfg)
            draft = edgellm_layout.read_builder_config(draft_dir, "draft")
            problems = edgellm_layout.tree_problems(tree, limits, draft)
            if problems:
                raise BackendError(f"the engines in {engine_dir} cannot draft {tree} (speculative.k / eagle3_tree): "
                                   + "; ".join(problems) + f": {build}, or change speculative.eagle3_tree")
    except edgellm_layout.ManifestError as err:
        raise BackendError(str(err)) from None
    except (ValueError, KeyError, TypeError) as err:
        raise BackendError(f"{engine_dir / edgellm_layout.CONFIG_FILE[role]} has no builder_config max_input_len / "
                           f"max_kv_cache_capacity ({type(err).__name__}: {err}): {build}") from None
    return EdgeLLMDirs(engine_dir, draft_dir, max_input, capacity, tree, visual_engine(cfg, build))


def load_native() -> ModuleType:
    """The pinned wheel's `_edgellm_runtime` for this device; BackendError saying what to install or why the
    wheel has no payload here (it ships Jetson Thor JetPack 7.x, DGX Spark, Orin JP 7.2 and x86-64 sm80-120)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("tensorrt-edgellm")
    except PackageNotFoundError:
        raise BackendError(f"runtime.backend tensorrt runs on TensorRT Edge-LLM: pip install --no-deps "
                           f"tensorrt-edgellm=={EDGELLM_VERSION} (scripts/setup.sh does on the device)") from None
    if found != EDGELLM_VERSION:
        raise BackendError(f"tensorrt-edgellm {found} is installed; spec_edge is checked against {EDGELLM_VERSION}: "
                           f"pip install --no-deps tensorrt-edgellm=={EDGELLM_VERSION}")
    from tensorrt_edgellm import runtime

    try:
        return runtime.load()
    except runtime.NativeRuntimeError as err:
        raise BackendError(f"tensorrt-edgellm cannot load its native runtime on this machine: {err}") from None


def guide(rt: ModuleType, kind: str, text: str):
    """The GuidedDecodingParams of a request's (kind, text) (grammar.grammar_spec; the front refused a Lark grammar:
    XGrammar reads EBNF, GBNF's syntax; tool_guide's structural_tag); RequestError for what Edge-LLM would not
    enforce."""
    guide_type = {"json_schema": rt.GuideType.JSON_SCHEMA, "regex": rt.GuideType.REGEX,
                  "structural_tag": rt.GuideType.STRUCTURAL_TAG}.get(kind, rt.GuideType.EBNF)
    params = rt.GuidedDecodingParams(guide_type, text)
    valid, reason = rt.validate_guided_decoding_params(params)
    if not valid:
        raise RequestError(f"{kind} is refused by Edge-LLM's guided decoding: {reason}")
    return params


def tool_guide(rt: ModuleType, fmt: ToolFormat, schemas: dict[str, dict], choice: str, parallel: bool):
    """The GuidedDecodingParams of a request's tool calls (Front.compile_tools): the format's structural tag (its
    grammar's language, tool_format.ToolFormat.structural_tag), each tool's schema first checked as Edge-LLM checks a
    json_schema guide (validate_guided_decoding_params: a keyword XGrammar accepts but does not enforce is refused;
    the structural tag itself is only checked to be JSON). RequestError naming runtime.backend: onnxruntime for what
    it cannot do."""
    for name, schema in schemas.items():
        try:
            guide(rt, "json_schema", json.dumps(schema))
        except RequestError as err:
            raise RequestError(f"tools: {name}'s parameters cannot be enforced by Edge-LLM ({err}): send such a tool "
                               "to a node with runtime.backend: onnxruntime, or drop the keyword") from None
    return guide(rt, "structural_tag", json.dumps(fmt.structural_tag(schemas, choice, parallel)))


class _Mode:
    """How requests reach Edge-LLM (the EdgeLLMEngine's strategy): LLMRuntime one at a time (_Serial) or the
    RequestEngine's in-flight batching (_Batched). name: how info() calls it; capacity: requests at once; drafters:
    what a request may ask for (a batched one runs target-only). run(call, channel, decoder, on_text, cancel, stats)
    serves one LLMGenerationRequest, its stream through decoder into on_text: (finish reason, message)."""
    name: str
    capacity: int
    drafters: tuple[str, ...]

    def __init__(self, rt: ModuleType):
        self.rt = rt

    def count_prompt_tokens(self, call) -> list[int]: ...

    def off_reason(self, drafter: str) -> str:
        """Why a request asking for drafter runs target-only here whatever else it asks ("": it may speculate)."""
        return ""

    def run(self, call, channel, decoder: StreamDecoder, on_text, cancel, stats: Stats) -> tuple[str, str]: ...

    def close(self) -> None: ...

    def drain(self, channel, stop_request, decoder: StreamDecoder, on_text, cancel, stats: Stats,
              producer_done: Callable[[], bool] = lambda: False, grace_s: float | None = None) -> tuple[str, str]:
        """Pop the channel until its last chunk: token ids -> decoder -> on_text; cancel() polled between
        waits. producer_done(): the producer is done with this channel (LLMRuntime: the call returned, a failed
        call may leave the channel unfinished; RequestEngine: the handle is terminal, ready(), and a request
        that retired without reaching the runtime never writes its channel). grace_s: after a cancel, stop
        waiting for the final chunk this long (None: wait for the producer). (finish reason, message)."""
        started = time.monotonic()
        cancelled, cancelled_at = "", 0.0
        while True:
            chunk = channel.wait_pop(POLL_MS)
            late = bool(cancelled) and grace_s is not None and time.monotonic() - cancelled_at > grace_s
            if chunk is None and (channel.is_finished() or producer_done() or late):
                chunk = channel.try_pop()  # the producer may have finished between the wait and the check
                if chunk is None:
                    stats.total_time_s = time.monotonic() - started
                    return (cancelled, "") if cancelled else ("error", "Edge-LLM ended the request without a final "
                                                                       "chunk (no finish reason)")
            if chunk is not None:
                if chunk.token_ids and not decoder.ids:
                    stats.time_to_first_token_s = time.monotonic() - started
                if chunk.token_ids:
                    delta = decoder.push(list(chunk.token_ids))
                    if delta and on_text is not None:
                        on_text(delta, len(decoder.ids))
                if chunk.finished:
                    stats.total_time_s = time.monotonic() - started
                    return self.finish(chunk.reason, cancelled)
            if not cancelled and cancel is not None and (reason := cancel()):
                cancelled, cancelled_at = reason, time.monotonic()
                stop_request()
            if decoder.stopped and not cancelled:  # our stop string showed up: end like the CPU path
                cancelled, cancelled_at = "stop", time.monotonic()
                stop_request()

    def finish(self, reason, cancelled: str) -> tuple[str, str]:
        rt = self.rt
        if reason == rt.FinishReason.END_ID:
            return "eos", ""
        if reason == rt.FinishReason.STOP_WORDS:
            return "stop", ""
        if reason == rt.FinishReason.LENGTH:
            return "length", ""
        if reason == rt.FinishReason.CANCELLED:
            return (cancelled or "cancelled"), ""
        if reason == rt.FinishReason.ERROR:
            return "error", "Edge-LLM reported an error for the request (FinishReason.ERROR)"
        what = "NOT_FINISHED" if reason == rt.FinishReason.NOT_FINISHED else repr(reason)
        return "error", f"Edge-LLM ended the stream with reason {what}"


class _Serial(_Mode):
    """graphs.batch_slots 1: LLMRuntime, speculative.drafter eagle3 over the base and draft engines (the chain or
    tree dirs.tree says) or none (the vanilla constructor); one request at a time (a lock), so the difference of its
    cumulative metrics around a request is that request's stats."""
    name, capacity = "LLMRuntime", 1

    def __init__(self, rt: ModuleType, cfg: Config, dirs: EdgeLLMDirs, cache, progress: Callable[[str], None]):
        super().__init__(rt)
        if cfg.speculative.drafter == "eagle3":
            tree = dirs.tree or edgellm_layout.eagle3_tree(cfg)
            self.runtime = rt.LLMRuntime(str(dirs.engine_dir), multimodal_dir(dirs.visual), {}, draft_top_k=tree.top_k,
                                         draft_step=tree.steps,
                                         verify_tree_size=tree.verify_size, draft_checkpoint_dir="",
                                         context_cache_config=cache)
            self.drafters = EDGELLM_DRAFTERS
        else:
            self.runtime = rt.LLMRuntime(str(dirs.engine_dir), multimodal_dir(dirs.visual), context_cache_config=cache)
            self.drafters = ("none",)
        if not self.runtime.capture_decoding_cuda_graph():
            progress("[engine] Edge-LLM could not capture CUDA graphs for decoding; running without")
        self._lock = threading.Lock()

    def count_prompt_tokens(self, call) -> list[int]:
        return list(self.runtime.count_prompt_tokens(call))

    def run(self, call, channel, decoder, on_text, cancel, stats) -> tuple[str, str]:
        """LLMRuntime.handle_request in a thread (it releases the GIL), its channel drained here."""
        with self._lock:
            spec_before, reused_before = self._counters()
            outcome = self._handle(call, channel, decoder, on_text, cancel, stats)
            spec_after, reused_after = self._counters()
        stats.verify_calls, stats.drafted, stats.accepted = (a - b for a, b in zip(spec_after, spec_before))
        stats.prompt_tokens_reused = reused_after - reused_before
        return outcome

    def _handle(self, call, channel, decoder, on_text, cancel, stats) -> tuple[str, str]:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.runtime.handle_request(call)
            except Exception as err:  # the runtime's failure becomes this request's finish_reason error
                failure.append(err)
                channel.cancel()

        worker = threading.Thread(target=run, name="edgellm-request", daemon=True)
        worker.start()
        try:
            outcome = self.drain(channel, channel.cancel, decoder, on_text, cancel, stats,
                                 producer_done=lambda: not worker.is_alive())
        finally:
            worker.join()
        if failure:
            return "error", f"Edge-LLM failed the request: {failure[0]}"
        return outcome

    def _counters(self) -> tuple[tuple[int, int, int], int]:
        """(SpecDecode (iterations, proposed, accepted), prefill reused tokens): cumulative since load."""
        counts, prefill = self.runtime.get_spec_decode_generation_metrics(), self.runtime.get_prefill_metrics()
        return ((int(counts.total_iterations), int(counts.total_proposed_draft_tokens),
                 int(counts.total_accepted_draft_tokens)), int(prefill.reused_tokens))

    def close(self) -> None:
        self.runtime = None


class _Batched(_Mode):
    """graphs.batch_slots B > 1: RequestEngine(max_batch_size=B), in-flight batching, requests from any thread. It
    cannot speculate: a request that asked for a drafter runs target-only and its result's speculation_off_reason
    says so."""
    name, drafters = "RequestEngine", EDGELLM_DRAFTERS

    def __init__(self, rt: ModuleType, cfg: Config, dirs: EdgeLLMDirs, cache):
        super().__init__(rt)
        self.capacity = slots = cfg.graphs.batch_slots
        self.batcher = rt.RequestEngine(str(dirs.engine_dir), multimodal_dir(dirs.visual), context_cache_config=cache,
                                        max_batch_size=slots,
                                        max_pending_requests=cfg.serve.queue_limit + slots)

    def count_prompt_tokens(self, call) -> list[int]:
        return list(self.batcher.count_prompt_tokens(call))

    def off_reason(self, drafter: str) -> str:
        return (f"graphs.batch_slots={self.capacity}: Edge-LLM's RequestEngine (in-flight batching) does not "
                f"speculate: ran target-only instead of drafter {drafter}") if drafter != "none" else ""

    def run(self, call, channel, decoder, on_text, cancel, stats) -> tuple[str, str]:
        rt = self.rt
        try:
            handle = self.batcher.submit(call)
        except rt.SubmitError as err:
            raise RequestError(f"Edge-LLM's request engine is full ({err}): retry later") from None
        return self.drain(handle.stream(), handle.cancel, decoder, on_text, cancel, stats,
                          producer_done=handle.ready, grace_s=CANCEL_GRACE_S)

    def close(self) -> None:
        """Stop the request engine (cancelling what is queued)."""
        rt = self.rt
        self.batcher.shutdown(rt.ShutdownMode.CANCEL)
        self.batcher = None


class EdgeLLMEngine:
    """A serving.Decoder over Edge-LLM. State: mode (how requests reach Edge-LLM: _Serial's LLMRuntime, batch_slots
    1, or _Batched's RequestEngine, batch_slots > 1), the tokenizer of the engine folder (our chat template and stream
    decoding), the builder limits, and the requests running on their threads."""

    def __init__(self, cfg: Config, rt: ModuleType, dirs: EdgeLLMDirs, progress: Callable[[str], None] = print):
        self.cfg, self.rt, self.dirs, self.progress = cfg, rt, dirs, progress
        self.tokenizer = Tokenizer(dirs.engine_dir)
        self.vocab_size = len(self.tokenizer.vocab())  # the ids a request's logit_bias may name
        self.max_context = dirs.max_kv_cache_capacity
        cache = rt.ContextCacheConfig()
        cache.enabled = cfg.serve.reuse_prefix
        self.mode: _Mode = (_Batched(rt, cfg, dirs, cache) if cfg.graphs.batch_slots > 1 else
                            _Serial(rt, cfg, dirs, cache, progress))
        self.capacity = self.mode.capacity
        self._running = 0  # requests added whose end iterate() has not delivered yet
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # (sink, result or exception) as each request ends
        k = speculative_k(cfg)
        self.capabilities = Capabilities(
            name="Edge-LLM", drafters=self.mode.drafters, k_values=(k,),
            k_remedy=f"the Edge-LLM runtime drafts a chain of k={k} (speculative.k, fixed at load): send k=0 or k={k}",
            max_context=self.max_context, max_input=min(dirs.max_input_len, self.max_context - 1),
            vocab_size=self.vocab_size, eos_ids=(), guided=("json_schema", "regex", "gbnf"), sampling=(),
            forced_drafts=False, images=dirs.visual.images if dirs.visual is not None else 0)
        self.image_span = (self.tokenizer.backend.decode(list(dirs.visual.span_ids), skip_special_tokens=False)
                           if dirs.visual is not None else "")  # what the model's chat template writes per image
        self._check_tokenizer()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print,
                    native: ModuleType | None = None) -> "EdgeLLMEngine":
        """Load the engines `spec-edge build` made for cfg's profile. native: the `_edgellm_runtime` module
        (None = the installed wheel's, load_native())."""
        started = time.monotonic()
        dirs = edgellm_dirs(cfg)
        engine = cls(cfg, native if native is not None else load_native(), dirs, progress)
        mode = f"{engine.capacity} batch slots" if engine.capacity > 1 else f"drafter {cfg.speculative.drafter}"
        mode += f" ({dirs.tree})" if dirs.tree is not None else ""
        progress(f"[engine] tensorrt (Edge-LLM {EDGELLM_VERSION}, {engine.mode.name}, {mode}) ready in {time.monotonic() - started:.1f} s "
                 f"from {dirs.engine_dir} (max input {dirs.max_input_len}, KV capacity {dirs.max_kv_cache_capacity})")
        return engine

    def guide(self, kind: str, text: str):
        return guide(self.rt, kind, text)

    def tool_guide(self, fmt: ToolFormat, schemas: dict[str, dict], choice: str, parallel: bool):
        return tool_guide(self.rt, fmt, schemas, choice, parallel)

    # -- the request -------------------------------------------------------------------------------
    def _check_tokenizer(self) -> None:
        """Refuse to serve when Edge-LLM's tokenizer counts our rendered probe conversation differently."""
        text = self.tokenizer.render_chat(list(PROBE))
        ours = len(self.tokenizer.encode(text))
        theirs = self.mode.count_prompt_tokens(self._call(text, 1))
        if theirs != [ours]:
            raise BackendError(f"Edge-LLM's tokenizer in {self.dirs.engine_dir} reads our chat prompt as {theirs} "
                               f"tokens, spec_edge's as {ours}: the engine folder's tokenizer.json differs from the "
                               f"model's; rebuild it with `spec-edge build`")

    def _call(self, text: str, max_new: int):
        """An LLMGenerationRequest for one pre-formatted prompt text (our template already applied)."""
        rt = self.rt
        item = rt.Request([rt.create_text_message("user", text)])
        call = rt.LLMGenerationRequest()
        call.requests = [item]
        call.apply_chat_template = False
        call.add_generation_prompt = False
        call.skip_special_tokens = True
        call.max_generate_length = max_new
        return call

    # -- the decoder (serving.Decoder): each request on a thread of its own -------------------------
    @property
    def occupied(self) -> int:
        return self._running

    def add(self, prepared: Prepared, sink: Sink, waiting: int) -> None:
        """Start the request on a thread of its own (Edge-LLM's calls block it); iterate() delivers its end."""
        queued = self._running + waiting + 1  # the load as it starts, itself included
        self._running += 1

        def run() -> None:
            try:
                self._ended.put((sink, self._serve(prepared, sink.on_text, sink.cancel_reason, queued)))
            except Exception as err:  # this request's failure, answered through its sink
                self._ended.put((sink, err))

        threading.Thread(target=run, name="edgellm-request", daemon=True).start()

    def iterate(self, waiting: int) -> None:
        """Wait up to POLL_MS for a request to end; hand its result to its sink."""
        try:
            sink, outcome = self._ended.get(timeout=POLL_MS / 1000)
        except queue.Empty:
            return
        self._running -= 1
        if isinstance(outcome, Exception):
            sink.failed(outcome)
        else:
            sink.done(outcome)

    def clear(self) -> None:
        """Forget the requests in it (their threads still end; nothing is delivered)."""
        self._running, self._ended = 0, queue.SimpleQueue()

    def _serve(self, prepared: Prepared, on_text: Callable[[str, int], None] | None,
               cancel: Callable[[], str | None] | None, queued: int) -> GenerateResult:
        """A prepared request through Edge-LLM, on the calling thread (see the module docstring for the mapping)."""
        request, params, drafter, max_new = prepared.request, prepared.sampling, prepared.drafter, prepared.max_new_tokens
        n_prompt = len(prepared.prompt_ids)
        # each image becomes at most tokens_per_image positions (QwenViTRunner::textPreprocess expands its pad)
        image_tokens = len(prepared.images) * self.dirs.visual.tokens_per_image if prepared.images else 0
        room = self.max_context - n_prompt - image_tokens  # KV capacity left after the prompt
        context_bound = max_new > room
        max_new = min(max_new, room)
        rt = self.rt
        if room < 1:
            raise RequestError(f"the prompt ({n_prompt} tokens) and its {len(prepared.images)} images (up to "
                               f"{image_tokens} tokens) leave no room in the {self.max_context} positions of this "
                               f"engine: send fewer images or a shorter prompt")
        text = prepared.text.replace(IMAGE_MARKER, self.image_span) if prepared.images else prepared.text
        call = self._call(text, max_new)
        item = call.requests[0]
        if prepared.images:  # in marker order: the Nth image span takes the Nth buffer
            buffers = []
            for pixels in prepared.images:
                image = rt.load_image_from_bytes(png(pixels))
                image.do_resize = True  # to the engine's token bounds (qwenSmartResize), as the wheel's server sets it
                buffers.append(image)
            item.image_buffers = buffers
        item.stop_strings = [s for s in request.stop if s]
        if params.logit_bias:
            item.logit_bias = dict(params.logit_bias)
        if prepared.guide is not None:
            item.guided_decoding = prepared.guide
        call.requests = [item]
        call.temperature, call.top_k, call.top_p = sampler_fields(params)
        sampled = non_greedy(call.temperature, call.top_k, call.top_p)
        if prepared.seed is not None:
            call.sampling_seed = prepared.seed
        call.context_cache_lookup_policy = (rt.ContextCacheLookupPolicy.USE_CACHE
                                            if self.cfg.serve.reuse_prefix and not prepared.images
                                            else rt.ContextCacheLookupPolicy.BYPASS)
        asked = speculative_k(self.cfg) if drafter == "eagle3" else 0
        k, off_reason, by_load = asked, self.mode.off_reason(drafter), False
        if off_reason:
            k = 0
        elif drafter != "none" and sampled:
            k, off_reason = 0, SAMPLED_OFF_REASON
        elif drafter != "none":  # the load as it starts: the whole request runs at that k
            k, by_load = speculation_policy.k_at(self.cfg.serve.speculate_k_by_load, queued, asked), True
        call.disable_spec_decode = k == 0
        channel = rt.StreamChannel.create()
        call.stream_channels = [channel]
        decoder = StreamDecoder(self.tokenizer, tuple(request.stop))
        stats = Stats(drafter=drafter if k else "none", k=k, prompt_tokens=n_prompt)
        answer = Answer(prepared.tool_format)  # with tools: the content streams without call markup

        def send(delta: str, n: int) -> None:
            if (delta := answer.push(delta)) and on_text is not None:
                on_text(delta, n)
        finish, error = self.mode.run(call, channel, decoder, send, cancel, stats)
        if tail := decoder.finish():
            send(tail, len(decoder.ids))
        ids = decoder.kept_ids()
        if finish == "length" and context_bound and len(ids) >= room:
            finish = "context_full"  # the CPU path's name for running out of context before max_new_tokens
        rest, text, calls, finish = answer.finish(decoder.text, finish)
        if rest and on_text is not None:
            on_text(rest, len(decoder.ids))
        stats.new_tokens = len(ids)
        if by_load and k < asked:  # the policy's k, as the loop counts it
            stats.k = asked
            stats.verify_calls_by_k = [stats.verify_calls if i + 1 == k else 0 for i in range(asked)]
            stats.policy_off_steps = 0 if k else len(ids)
            off_reason = speculation_policy.reason(stats, self.cfg.serve.speculate_k_by_load)
        return GenerateResult(text=text, token_ids=ids, finish_reason=finish, stats=stats, tool_calls=calls,
                              prompt_tokens=n_prompt, queued_at_start=queued, speculation_off_reason=off_reason,
                              message=error)

    # -- serving ------------------------------------------------------------------------------------
    def warm(self, prefix_ids: list[int]) -> None:
        """Put a chat prefix many requests share (Front.shared_prefix) into the context cache (one prefill,
        PREFILL_STATE_ONLY), so the next such request reuses it."""
        call = self._call(self.tokenizer.backend.decode(prefix_ids, skip_special_tokens=False), 1)  # markers kept
        rt = self.rt
        call.context_cache_lookup_policy = rt.ContextCacheLookupPolicy.USE_CACHE
        call.context_cache_commit_policy = rt.ContextCacheCommitPolicy.PREFILL_STATE_ONLY
        call.disable_spec_decode = True
        channel = rt.StreamChannel.create()
        call.stream_channels = [channel]
        self.mode.run(call, channel, StreamDecoder(self.tokenizer), None, None, Stats())

    def info(self) -> dict:
        import resource

        return {"backend": self.cfg.runtime.backend, "runtime": f"tensorrt-edgellm {EDGELLM_VERSION}",
                "mode": self.mode.name, "engine_dir": str(self.dirs.engine_dir), "max_context": self.max_context,
                "max_input_len": self.dirs.max_input_len, "drafter": self.cfg.speculative.drafter,
                "k": self.cfg.speculative.k, "k_values": [speculative_k(self.cfg)],
                "batch_slots": self.cfg.graphs.batch_slots, "images_per_request": self.capabilities.images,
                "speculate_k_by_load": list(self.cfg.serve.speculate_k_by_load),
                "speculation_policy": speculation_policy.describe(self.cfg.serve.speculate_k_by_load),
                "memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def close(self) -> None:
        self.mode.close()  # RequestEngine: cancels what is queued
