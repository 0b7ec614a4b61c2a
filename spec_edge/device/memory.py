"""Memory plan of a TensorRT deployment: pure byte arithmetic, a refusal with the numbers, and the
largest cache that fits. `spec-edge plan <profile>` prints it; `spec-edge build` runs it before any
export or engine build starts. The decode-speed projection (the k table) is projection.py. Units:
every `*_gb` value in the config is GiB (2**30 bytes); every number here is bytes.

Engine layout (decided here, built by builder.py, counted here)
---------------------------------------------------------------
A TensorRT engine embeds its own copy of every weight it uses. One engine per graph shape
(prefill C, step 1, verify k+1 ...) would therefore hold the 16 GB of an 8B bf16 target three or
four times. Instead each model gets ONE engine that holds every width it runs: the ONNX graph is
exported with a dynamic token axis T, and the engine gets one optimization profile per width with
min = opt = max = T, so TensorRT still tunes fixed-shape kernels per width while the weights are
stored once. The prefill chunk is simply the width-C profile (the backend picks the last real row
of its (C, V) logits on the device). So:

  target engine   weights x 1, widths {C, 1, k+1 for each k in graphs.k_values}
  draft engine    weights x 1 (drafter=draft), widths {C, 1}
  layer-skip      a separate engine over the target's first n layers + final norm + head: its
                  weights ARE a second copy of those layers, the embedding and the head, and are
                  counted as such; its KV is the target's first n cache layers (no extra KV).
  batch_slots B>1 one target engine over the (n, T) graph (graphs/batch_dynamic.py): weights x 1, B cache
                  regions, decode profiles of 1..B rows, the prefill chunk alone (target_rows)

When a profile's ONNX folder holds only static per-width graphs, specs.engine_specs() gives one engine per
graph and the plan counts a weight copy per engine (`layout="per_graph"`): 98 instead of 35 GiB (8B + 1B bf16).

Tied embeddings (Llama-3.2-1B, Qwen3-0.6B): the Gather table and the lm_head GEMM weight are two engine
constants, counted twice (conservative; the build manifest's measured engine size replaces the estimate).

Execution is serialised on one CUDA stream, so all execution contexts of all engines share ONE
scratch buffer (TensorRT USER_MANAGED context memory) sized to the largest profile: activations
are counted once, as the maximum over models and widths, not summed.

Precision bytes per weight (linear layers only: q/k/v/o, gate/up/down; embeddings, lm_head and
norms stay in the activation dtype, as ModelOpt's default FP8/NVFP4 recipes leave them):
  float32 4, float16/bfloat16 2,
  fp8   1 byte + one fp32 scale per tensor for the weight and one for its input,
  nvfp4 0.5 byte (E2M1) + one FP8 E4M3 scale per 16-element block (1/16 byte) = 0.5625 byte,
        + one fp32 global scale per tensor for the weight and one for its input,
  int4_awq  0.5 byte + one dtype scale per graphs.int4_block weights + the AWQ pre-scale (K per layer),
  int4_gguf 0.5 byte + one dtype scale and one dtype minimum per 32 weights (the GGUF's Q4_1),
(graphs.weights; graphs/qdq.py writes them). Once the quantized folder exists (`spec-edge build
--export-only`), the target's weights are its weights.bin's real size instead.
The KV cache stays in graphs.dtype (2 bytes for bf16).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spec_edge.config import ConfigError, GraphSection, MemorySection, ModelConfig
from spec_edge.device import head_memory
from spec_edge.device.engine_file import load_peak_bytes

if TYPE_CHECKING:
    from spec_edge.heads.eagle3 import HeadConfig

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
QUANTIZATIONS = ("fp32", "int4_awq", "int4_gguf", "fp8", "nvfp4")  # graphs.weights values TensorRT builds
LINEARS_PER_LAYER = 7          # q, k, v, o, gate, up, down
NVFP4_BLOCK = 16               # elements per FP8 block scale
CONTEXT_STEP = 256             # the largest max_context is reported in multiples of this


class PlanError(ConfigError):
    """A plan that does not fit the device; the message holds the whole table."""


# ---------------------------------------------------------------------------------------------
# Pure arithmetic


def weight_bytes(m: ModelConfig, dtype: str, quantization: str = "fp32", n_layers: int | None = None,
                 tied_copies: int = 2, int4_block: int = 128) -> int:
    """Bytes of the weights an engine of `m` (or of its first n_layers) holds.

    linear weights in the quantized format (or dtype), embedding + head + norms in dtype; a tied
    embedding counts `tied_copies` times (Gather table + GEMM weight are two engine constants)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    layers = m.n_layers if n_layers is None else n_layers
    dt = DTYPE_BYTES[dtype]
    h, d = m.hidden_size, m.head_dim
    linear = h * d * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * h * m.intermediate_size
    norms = 2 * h + (2 * d if m.qk_norm else 0)
    if quantization == "fp32":
        linear_bytes = linear * dt
    elif quantization == "fp8":
        linear_bytes = linear + LINEARS_PER_LAYER * 2 * 4
    elif quantization == "int4_awq":  # codes + a scale per block + the AWQ pre-scale of each layer's input
        pre = h * 4 + h * 2 + d * m.n_heads + m.intermediate_size  # q/k/v, gate/up, o, down inputs
        linear_bytes = linear // 2 + linear // int4_block * dt + pre * dt
    elif quantization == "int4_gguf":  # codes + scale d + minimum per 32 weights
        linear_bytes = linear // 2 + linear // 32 * 2 * dt
    else:  # nvfp4: 4-bit values + FP8 scale per 16-element block + 2 fp32 global scales per tensor
        linear_bytes = linear // 2 + linear // NVFP4_BLOCK + LINEARS_PER_LAYER * 2 * 4
    embed = m.vocab_size * h * (tied_copies if m.tie_embeddings else 2)
    return layers * (linear_bytes + norms * dt) + (embed + h) * dt


def kv_bytes(m: ModelConfig, max_context: int, dtype: str, n_layers: int | None = None) -> int:
    """K + V cache (L, Hkv, S, D) x 2 in dtype."""
    layers = m.n_layers if n_layers is None else n_layers
    return 2 * layers * m.n_kv_heads * max_context * m.head_dim * DTYPE_BYTES[dtype]


def activation_bytes(m: ModelConfig, max_context: int, width: int, dtype: str) -> int:
    """Peak live intermediates of one width-T call (TensorRT reuses them layer after layer), for
    the graph of spec_edge/graphs/model.py:
      dense   T x (2 hidden [residual, normed] + (Hq + 2 Hkv) D [q,k,v] + Hq D [attn out]
                   + 3 inter [gate, up, act]) in dtype
      concat  keys and values of one layer, cache + new: 2 x Hkv x (S + T) x D in dtype
      scores  Hq x T x (S + T) three times: scores (dtype), fp32 softmax (4), probs (dtype)
      head    T x V in dtype before the float32 cast
    An estimate: the engine's device_memory_size replaces it once built (build manifest)."""
    dt = DTYPE_BYTES[dtype]
    t, s = width, max_context
    h, d, hq, hkv = m.hidden_size, m.head_dim, m.n_heads, m.n_kv_heads
    dense = t * (2 * h + (hq + 2 * hkv) * d + hq * d + 3 * m.intermediate_size) * dt
    concat = 2 * hkv * (s + t) * d * dt
    scores = hq * t * (s + t) * (2 * dt + 4)
    head = t * m.vocab_size * dt
    return dense + concat + scores + head


def io_bytes(m: ModelConfig, width: int, dtype: str, n_layers: int | None = None) -> int:
    """Engine outputs the backend allocates once at the widest width: logits (T, V) float32 and
    k_new / v_new (L, Hkv, T, D); plus tokens (1, T), position, last_index int64."""
    layers = m.n_layers if n_layers is None else n_layers
    return (width * m.vocab_size * 4 + 2 * layers * m.n_kv_heads * width * m.head_dim * DTYPE_BYTES[dtype]
            + (width + 2) * 8)


def target_widths(graphs: GraphSection) -> tuple[int, ...]:
    """Widths of the target engine's profiles: prefill chunk, step, each verify."""
    return tuple(sorted({graphs.prefill_chunk, 1, *(k + 1 for k in graphs.k_values)}))


def target_rows(graphs: GraphSection) -> dict[int, tuple[int, int, int]]:
    """Rows n (min, opt, max) per target width: decode widths 1..B (opt B, the busy case), the chunk C alone."""
    b = graphs.batch_slots
    decode = {1, *(k + 1 for k in graphs.k_values)}
    return {w: (1, b, b) if w in decode else (1, 1, 1) for w in target_widths(graphs)}


def draft_widths(graphs: GraphSection) -> tuple[int, ...]:
    """Widths of the draft engine: prefill chunk and step (export.graph_plan's draft graphs)."""
    return tuple(sorted({graphs.prefill_chunk, 1}))


@dataclass(frozen=True)
class DeviceMemory:
    """Memory as read on the device: total and available now (bytes), and where it was read."""
    total: int
    available: int
    source: str


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on (no files, no device): see plan()."""
    target: ModelConfig
    graphs: GraphSection
    memory: MemorySection
    drafter: str = "none"             # speculative.drafter
    k: int = 4                        # speculative.k
    draft: ModelConfig | None = None  # drafter == "draft"
    layout: str = "shared"            # shared: one engine per model; per_graph: one per width
    measured_activation: int | None = None  # an engine's device_memory_size, when built
    head: "HeadConfig | None" = None  # drafter eagle3 / hybrid: the EAGLE-3 head engine
    hidden_layers: int = 0            # hidden states the target returns for the head (3 for EAGLE-3)
    measured_target_weights: int | None = None  # bytes of the quantized folder's weights.bin, when made


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    max_context: int
    lines: tuple[tuple[str, int], ...]  # (what, bytes) in display order, reserve last
    total: int
    device: int                         # bytes the plan may use (config, capped by the device)
    device_source: str                  # "config" or where it was measured
    available_now: int | None           # measured free memory now, None off the device
    build_peak: int                     # bytes while the largest engine is built
    largest_max_context: int            # the largest S (multiple of CONTEXT_STEP) that fits
    context_cap: int = 0                # the models' position limit the search stops at

    @property
    def fits(self) -> bool:
        return self.load_peak <= self.device and self.build_peak <= self.device and (
            self.available_now is None or self.runtime_need <= self.available_now)

    @property
    def load_peak(self) -> int:
        """At start: everything resident plus the one read buffer engines are streamed through."""
        return self.total + load_peak_bytes()

    @property
    def runtime_need(self) -> int:
        """What the service allocates itself: everything but the OS + ROS reserve."""
        return self.total - dict(self.lines)["OS + ROS reserve"]

    def table(self) -> str:
        i = self.inputs
        title = (f"plan: target {i.target.name or '?'} {_precision(i)}"
                 + (f" + draft {i.draft.name or '?'} {i.graphs.dtype}" if i.draft is not None else "")
                 + f", drafter={i.drafter}, k={i.k}, max_context={self.max_context}, layout={i.layout}")
        rows = [title]
        for what, n in self.lines:
            rows.append(f"  {what:<46s} {_gib(n):>10s}")
        rows.append(f"  {'total':<46s} {_gib(self.total):>10s}")
        rows.append(f"  {'device memory (' + self.device_source + ')':<46s} {_gib(self.device):>10s}"
                    f"   {'fits' if self.total <= self.device else 'DOES NOT FIT'}"
                    f" ({_gib(self.device - self.total)} headroom)")
        rows.append(f"  {'load peak (engines streamed, 64 MiB reads)':<46s} {_gib(self.load_peak):>10s}"
                    f"   {'fits' if self.load_peak <= self.device else 'DOES NOT FIT'}")
        rows.append(f"  {'build peak (largest engine)':<46s} {_gib(self.build_peak):>10s}"
                    f"   {'fits' if self.build_peak <= self.device else 'DOES NOT FIT'}")
        if self.available_now is not None:
            rows.append(f"  {'service allocations vs free now':<46s} {_gib(self.runtime_need):>10s}"
                        f" of {_gib(self.available_now)} available now")
        capped = " (the model's position limit)" if self.largest_max_context >= self.context_cap else ""
        rows.append(f"  largest max_context that fits with k={i.k}: {self.largest_max_context}{capped}")
        return "\n".join(rows)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _precision(i: PlanInputs) -> str:
    q = _quantization(i.graphs)
    return i.graphs.dtype if q == "fp32" else f"{q} weights / {i.graphs.dtype} activations"


def _quantization(graphs: GraphSection) -> str:
    if graphs.weights not in QUANTIZATIONS:
        raise ConfigError(f"graphs.weights={graphs.weights} is an ONNX Runtime form; TensorRT builds "
                          f"{', '.join(QUANTIZATIONS)}")
    return graphs.weights


def _breakdown(i: PlanInputs, max_context: int) -> tuple[list[tuple[str, int]], int]:
    """(lines, build_peak) for one cache length."""
    g, mem, dtype = i.graphs, i.memory, i.graphs.dtype
    quant = _quantization(g)
    t_widths = target_widths(g)
    copies = 1 if i.layout == "shared" else len(t_widths)
    target_w = weight_bytes(i.target, dtype, quant, int4_block=g.int4_block)
    measured = ""
    if i.measured_target_weights is not None:  # the produced file (scales, minima, pre-scales included)
        tied = i.target.vocab_size * i.target.hidden_size * DTYPE_BYTES[dtype] if i.target.tie_embeddings else 0
        target_w, measured = i.measured_target_weights + tied, ", file"
    lines: list[tuple[str, int]] = [(f"target weights ({copies} engine{'s' if copies > 1 else ''}{measured})",
                                     target_w * copies)]
    engines = [target_w]
    draft_w = draft_kv = 0
    b = g.batch_slots  # B slots: B cache regions; a width's call runs up to its profile's rows (target_rows)
    rows = target_rows(g)
    acts = [max(rows[w][2] * activation_bytes(i.target, max_context, w, dtype) for w in t_widths)]
    io = max(rows[w][2] * io_bytes(i.target, w, dtype) for w in t_widths)  # one buffer, the largest call
    if i.drafter == "draft":
        if i.draft is None:
            raise ConfigError("speculative.drafter=draft needs model.draft (a model folder or preset)")
        d_widths = draft_widths(g)
        d_copies = 1 if i.layout == "shared" else len(d_widths)
        one = weight_bytes(i.draft, dtype)
        draft_w = one * d_copies
        engines.append(one)
        draft_kv = b * kv_bytes(i.draft, max_context, dtype)
        acts.append(b * max(activation_bytes(i.draft, max_context, w, dtype) for w in d_widths))
        io += b * io_bytes(i.draft, max(d_widths), dtype)
    elif i.drafter == "layerskip":
        n = g.layer_skip_layers
        if not 1 <= n < i.target.n_layers:
            raise ConfigError(f"graphs.layer_skip_layers must be in [1, {i.target.n_layers - 1}], got {n}")
        one = weight_bytes(i.target, dtype, quant, n_layers=n, int4_block=g.int4_block)
        draft_w = one
        engines.append(one)
        io += b * io_bytes(i.target, 2, dtype, n_layers=n)
    if i.head is None:  # a head's own lines follow
        lines.append(("draft weights" if i.drafter != "layerskip"
                      else f"layer-skip engine weights ({g.layer_skip_layers} layers + head)", draft_w))
    lines.append((f"target KV ({b} x {max_context} positions)" if b > 1 else f"target KV ({max_context} positions)",
                  b * kv_bytes(i.target, max_context, dtype)))
    if i.head is None:
        lines.append(("draft KV" if i.drafter != "layerskip" else "draft KV (shares target layers)", draft_kv))
    else:
        # the target graph takes the embedding as an input (embed_table): its engine holds no copy, one
        # device table serves target and head
        dt, h_widths = DTYPE_BYTES[dtype], head_memory.head_widths(g)
        in_engine = head_memory.embedding_in_engine(i.target, dt)
        lines[0] = (lines[0][0], lines[0][1] - in_engine * copies)
        engines[0] -= in_engine
        engines.append(head_memory.head_weight_bytes(i.head, dt))
        lines += [("shared embedding table (target + head)", i.target.vocab_size * i.target.hidden_size * dt),
                  (f"EAGLE-3 head weights (Vd={i.head.draft_vocab_size})", engines[-1]),
                  (f"EAGLE-3 head KV ({max_context} positions)", head_memory.head_kv_bytes(i.head, max_context, dt)),
                  (f"target hidden states ({i.hidden_layers} x H: widths + S rows)",
                   head_memory.hidden_bytes(i.target, i.hidden_layers, t_widths, max_context, dt)),
                  (f"EAGLE-3 head I/O ({len(h_widths) + 1} profiles)",
                   head_memory.head_io_bytes(i.head, h_widths + (1,), dt))]
        acts.append(activation_bytes(i.head.as_model_config(), max_context, max(h_widths), dtype))
    activation = i.measured_activation if i.measured_activation is not None else max(acts)
    lines.append(("activations (shared scratch" + (", measured)" if i.measured_activation is not None
                                                  else ", estimate)"), activation))
    lines.append(("engine I/O buffers (logits, k_new, v_new)", io))
    workspace = int(mem.workspace_gb * GIB)
    lines.append(("TensorRT workspace limit", workspace))
    overhead = int(mem.context_overhead_gb * GIB)
    lines.append(("TensorRT + CUDA context", overhead))
    reserve = int(mem.os_ros_reserve_gb * GIB)
    lines.append(("OS + ROS reserve", reserve))
    # Building the largest engine holds the parsed ONNX weights (host = device memory on Thor),
    # the engine being built and its serialized copy, plus the builder workspace.
    build_peak = 3 * max(engines) + workspace + overhead + reserve
    return lines, build_peak


def plan(i: PlanInputs, device: DeviceMemory | None = None) -> Plan:
    """The breakdown at graphs.max_context, and the largest max_context that fits.

    The device budget is memory.device_memory_gb, capped by the measured total when `device` is
    given (on Thor: /proc/meminfo MemTotal of the unified memory)."""
    if i.layout not in ("shared", "per_graph"):
        raise ConfigError(f"unknown engine layout {i.layout!r}")
    budget = int(i.memory.device_memory_gb * GIB)
    source = "config"
    if device is not None and device.total < budget:
        budget, source = device.total, device.source
    s = i.graphs.max_context
    lines, build_peak = _breakdown(i, s)
    total = sum(n for _, n in lines)

    def fits(ctx: int) -> bool:
        ls, _ = _breakdown(i, ctx)
        return sum(n for _, n in ls) <= budget

    cap = i.target.max_position_embeddings
    if i.drafter == "draft" and i.draft is not None:
        cap = min(cap, i.draft.max_position_embeddings)
    lo, hi = 0, cap // CONTEXT_STEP  # in steps; fits() is monotonic in the cache length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CONTEXT_STEP):
            lo = mid
        else:
            hi = mid - 1
    return Plan(inputs=i, max_context=s, lines=tuple(lines), total=total, device=budget,
                device_source=source, available_now=None if device is None else device.available,
                build_peak=build_peak, largest_max_context=lo * CONTEXT_STEP,
                context_cap=cap // CONTEXT_STEP * CONTEXT_STEP)


def check(p: Plan) -> Plan:
    """Return the plan when it fits; raise PlanError with the table and what to change."""
    if p.fits:
        return p
    hints = []
    if p.total > p.device:
        hints.append(f"the plan needs {_gib(p.total)} of {_gib(p.device)}")
        if p.largest_max_context >= p.inputs.graphs.prefill_chunk:
            hints.append(f"set graphs.max_context <= {p.largest_max_context}")
        if _quantization(p.inputs.graphs) == "fp32":
            hints.append("or quantize the target (graphs.weights: int4_awq, fp8 or nvfp4)")
    if p.build_peak > p.device:
        hints.append(f"building the largest engine needs {_gib(p.build_peak)}: quantize, or lower memory.workspace_gb")
    if p.available_now is not None and p.runtime_need > p.available_now:
        hints.append(f"only {_gib(p.available_now)} is free now for {_gib(p.runtime_need)}: stop other "
                     "processes or lower graphs.max_context")
    raise PlanError("memory plan does not fit: " + "; ".join(hints) + "\n" + p.table())


# ---------------------------------------------------------------------------------------------
# Reading the device (not pure; kept apart)


def read_device_memory() -> DeviceMemory | None:
    """The device's memory: a Jetson's unified memory (/proc/meminfo), a discrete GPU's
    torch.cuda.mem_get_info, None elsewhere (plan with the config's memory.device_memory_gb)."""
    from spec_edge.device.meminfo import is_jetson, parse_meminfo

    if is_jetson():
        total, available = parse_meminfo(Path("/proc/meminfo").read_text())
        return DeviceMemory(total, available, "/proc/meminfo, unified")
    if os.environ.get("SPEC_EDGE_NO_CUDA_PROBE"):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return DeviceMemory(int(total), int(free), f"cuda:{torch.cuda.current_device()} mem_get_info")
