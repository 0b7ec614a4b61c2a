"""Memory plan of a TensorRT Edge-LLM deployment: pure byte arithmetic, a refusal with the numbers, and
the largest KV capacity that fits. `spec-edge plan <profile>` prints it; `spec-edge build` runs it before
any stage starts. The decode-speed projection (the k table) is projection.py. Units: every `*_gb` value
in the config is GiB (2**30 bytes); every number here is bytes.

What Edge-LLM builds for a profile (edgellm_build.py) and what each costs
-------------------------------------------------------------------------
  target engine   every decoder layer's linear weights in the graphs.weights form, the final norm and the
                  lm_head in fp16 (ModelOpt's recipes leave lm_head unquantized); ONE engine holds all
                  shapes (dynamic token axis, paged KV).
  embedding       embedding.safetensors, fp16 (V x H), looked up outside the engine: a separate copy even
                  when the checkpoint ties it to lm_head.
  paged KV        K + V of every layer, fp16, for max_kv_cache_capacity = graphs.max_context positions
                  (rounded up to Edge-LLM's 128-token pages) per sequence, x max_batch_size sequences.
  EAGLE-3 head    drafter eagle3: its own engine (fc 3Ht -> H, one layer whose q/k/v read 2H, MLP,
                  lm_head over the draft vocabulary, fp16) + d2t (int32) + its own one-layer paged KV; the
                  target engine then also writes 3 hidden states (3H fp16) per token it runs.
  activations     one call of max_input_len = graphs.max_context tokens (the widest Edge-LLM plans for):
                  the dense intermediates of one layer (the attention plugin never materialises T x S
                  scores) + the logits of the selected tokens (float32). An estimate.
  visual engine   graphs.max_image_tokens > 0 (a Qwen-VL target): VisualBuilder's engine of the vision tower, fp16
                  (tensorrt-edgellm-export --dtype float16, its default), loaded by each runtime (LLMRuntime and
                  RequestEngine both take multimodal_engine_dir), and its activations for the widest call the engine
                  is built for, max_image_tokens x 4 patches (VisualBuilder::setupQwenViTProfile: maxHW =
                  maxImageTokens x 4, spatial_merge_size 2 squared). visual_weight_bytes counts the tower as
                  tensorrt_edgellm/models/qwen2_5_vl/modeling_qwen2_5_vl_visual.py builds it.
  runtimes        LLMRuntime (batch 1; speculative when drafter eagle3) or RequestEngine (graphs.batch_slots
                  B > 1, no speculation). B > 1 with drafter eagle3: the node may switch between both, so
                  both are resident: a batch-1 EAGLE-3 base engine + head AND a batch-B plain engine (its own
                  weights copy, KV and activations), each with its CUDA + TensorRT context.
  OS + ROS        memory.os_ros_reserve_gb.

Bytes per linear weight (graphs.weights): fp32 = not quantized, fp16 2; fp8 1 + an fp32 scale per tensor
for the weight and one for its input; nvfp4 0.5 + one FP8 scale per 16 (1/16) + 2 fp32 per tensor;
int4_awq 0.5 + one fp16 scale per 128 weights (ModelOpt's INT4_AWQ block) + the fp16 AWQ pre-scale of
each linear's input.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spec_edge.config import ConfigError, GraphSection, MemorySection, ModelConfig

if TYPE_CHECKING:
    from spec_edge.heads.eagle3 import HeadConfig

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2}
FP16 = 2
QUANTIZATIONS = ("fp32", "int4_awq", "fp8", "nvfp4")  # graphs.weights Edge-LLM builds (fp32: fp16, not quantized)
LINEARS_PER_LAYER = 7          # q, k, v, o, gate, up, down
NVFP4_BLOCK = 16               # elements per FP8 block scale
INT4_AWQ_BLOCK = 128           # ModelOpt INT4_AWQ_CFG block size (tensorrt-edgellm-quantize)
KV_PAGE = 128                  # Edge-LLM's KV page (tensorrt_edgellm.models.ops.KV_PAGE_SIZE)
CONTEXT_STEP = 256             # the largest max_context is reported in multiples of this


class PlanError(ConfigError):
    """A plan that does not fit the device; the message holds the whole table."""


# ---------------------------------------------------------------------------------------------
# Pure arithmetic


def linear_bytes(m: ModelConfig, quantization: str) -> int:
    """Bytes of one decoder layer's seven linear weights in a graphs.weights form."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"graphs.weights={quantization} is not a TensorRT Edge-LLM form; use one of "
                          f"{', '.join(QUANTIZATIONS)}")
    h, d = m.hidden_size, m.head_dim
    n = h * d * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * h * m.intermediate_size
    if quantization == "fp32":
        return n * FP16
    if quantization == "fp8":
        return n + LINEARS_PER_LAYER * 2 * 4
    if quantization == "nvfp4":
        return n // 2 + n // NVFP4_BLOCK + LINEARS_PER_LAYER * 2 * 4
    pre = h * 4 + h * 2 + d * m.n_heads + m.intermediate_size  # int4_awq: q/k/v, gate/up, o, down inputs
    return n // 2 + n // INT4_AWQ_BLOCK * FP16 + pre * FP16


def weight_bytes(m: ModelConfig, quantization: str = "fp32", n_layers: int | None = None) -> int:
    """Bytes of the target engine's weights: layers (linears in the form, norms fp16), final norm and
    lm_head (fp16). The embedding table is embedding_bytes (outside the engine)."""
    layers = m.n_layers if n_layers is None else n_layers
    norms = 2 * m.hidden_size + (2 * m.head_dim if m.qk_norm else 0)
    return layers * (linear_bytes(m, quantization) + norms * FP16) + (m.vocab_size + 1) * m.hidden_size * FP16


def embedding_bytes(m: ModelConfig) -> int:
    """embedding.safetensors: the fp16 token table (V, H)."""
    return m.vocab_size * m.hidden_size * FP16


def kv_capacity(max_context: int) -> int:
    """Positions of KV one sequence gets: max_context rounded up to whole pages."""
    return -(-max_context // KV_PAGE) * KV_PAGE


def kv_bytes(m: ModelConfig, max_context: int, n_layers: int | None = None) -> int:
    """K + V of one sequence's paged cache, fp16: 2 x L x Hkv x capacity x D."""
    layers = m.n_layers if n_layers is None else n_layers
    return 2 * layers * m.n_kv_heads * kv_capacity(max_context) * m.head_dim * FP16


def activation_bytes(m: ModelConfig, tokens: int, logits_rows: int) -> int:
    """One call over `tokens` tokens: one layer's dense intermediates (residual, normed, q/k/v, attention
    out, gate/up/act) in fp16, + logits (rows, V) float32. An estimate."""
    h, d = m.hidden_size, m.head_dim
    dense = tokens * (2 * h + (m.n_heads + 2 * m.n_kv_heads) * d + m.n_heads * d + 3 * m.intermediate_size) * FP16
    return dense + logits_rows * m.vocab_size * 4


def head_weight_bytes(h: "HeadConfig") -> int:
    """The EAGLE-3 draft engine's weights (fp16): fc (3Ht -> H), the layer (q/k/v over 2H, o, MLP),
    lm_head over the draft vocabulary, four norms, + d2t (Vd int32)."""
    H, D = h.hidden_size, h.head_dim
    n = (3 * h.target_hidden_size * H + 2 * H * D * (h.n_heads + 2 * h.n_kv_heads) + H * D * h.n_heads
         + 3 * H * h.intermediate_size + h.draft_vocab_size * H)
    return (n + 4 * H) * FP16 + h.draft_vocab_size * 4


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen-VL vision tower's geometry (the checkpoint's config.json vision_config)."""
    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3

    @classmethod
    def from_hf(cls, vision: dict) -> "VisionConfig":
        return cls(depth=int(vision["depth"]), hidden_size=int(vision["hidden_size"]),
                   intermediate_size=int(vision["intermediate_size"]), out_hidden_size=int(vision["out_hidden_size"]),
                   patch_size=int(vision.get("patch_size", 14)),
                   temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                   spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                   in_channels=int(vision.get("in_chans", vision.get("in_channels", 3))))


def visual_weight_bytes(v: VisionConfig) -> int:
    """The visual engine's weights, fp16, as modeling_qwen2_5_vl_visual.py builds the tower: the patch embedding
    (Conv3d, no bias), per block qkv (H -> 3H) and proj (H -> H) with biases, the SwiGLU MLP (gate / up H -> I,
    down I -> H, biases) and two RMSNorms, the merger (RMSNorm, 4H -> 4H, GELU, 4H -> out, biases)."""
    h, i, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h
    block = (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h) + 2 * h
    merger = h + (m * m + m) + (m * v.out_hidden_size + v.out_hidden_size)
    return (patch + v.depth * block + merger) * FP16


def visual_activation_bytes(v: VisionConfig, image_tokens: int) -> int:
    """One visual engine call at its widest: image_tokens x merge^2 patches through one block's dense intermediates
    (residual, normed, qkv, attention out, gate / up / act) in fp16, its input (patches x C x T x P x P, fp16)
    and rotary table (float32), and the image-token embeddings it returns (fp16). An estimate."""
    patches = image_tokens * v.spatial_merge_size ** 2
    h, i = v.hidden_size, v.intermediate_size
    dense = patches * (2 * h + 3 * h + h + 3 * i) * FP16
    pixels = patches * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * FP16
    rotary = patches * (h // 16) * 4  # head_dim / 2 of 16 heads' rotary, float32 (an upper estimate)
    return dense + pixels + rotary + image_tokens * v.out_hidden_size * FP16


def head_kv_bytes(h: "HeadConfig", max_context: int) -> int:
    """The head's own one-layer paged K + V, fp16."""
    return 2 * h.n_kv_heads * kv_capacity(max_context) * h.head_dim * FP16


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
    drafter: str = "none"             # speculative.drafter: eagle3 | none (what Edge-LLM runs)
    k: int = 4                        # speculative.k
    head: "HeadConfig | None" = None  # drafter eagle3: the EAGLE-3 head
    vision: VisionConfig | None = None  # graphs.max_image_tokens > 0: the target's vision tower


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
    context_cap: int = 0                # the model's position limit the search stops at

    @property
    def fits(self) -> bool:
        return self.total <= self.device and self.build_peak <= self.device and (
            self.available_now is None or self.runtime_need <= self.available_now)

    @property
    def runtime_need(self) -> int:
        """What the service allocates itself: everything but the OS + ROS reserve."""
        return self.total - dict(self.lines)["OS + ROS reserve"]

    def table(self) -> str:
        i = self.inputs
        title = (f"plan: target {i.target.name or '?'} {_precision(i)}, drafter={i.drafter}, k={i.k}, "
                 f"max_context={self.max_context}, batch_slots={i.graphs.batch_slots} (TensorRT Edge-LLM)")
        rows = [title]
        for what, n in self.lines:
            rows.append(f"  {what:<58s} {_gib(n):>10s}")
        rows.append(f"  {'total':<58s} {_gib(self.total):>10s}")
        rows.append(f"  {'device memory (' + self.device_source + ')':<58s} {_gib(self.device):>10s}"
                    f"   {'fits' if self.total <= self.device else 'DOES NOT FIT'}"
                    f" ({_gib(self.device - self.total)} headroom)")
        rows.append(f"  {'build peak (largest engine)':<58s} {_gib(self.build_peak):>10s}"
                    f"   {'fits' if self.build_peak <= self.device else 'DOES NOT FIT'}")
        if self.available_now is not None:
            rows.append(f"  {'service allocations vs free now':<58s} {_gib(self.runtime_need):>10s}"
                        f" of {_gib(self.available_now)} available now")
        capped = " (the model's position limit)" if self.largest_max_context >= self.context_cap else ""
        rows.append(f"  largest max_context (KV capacity) that fits with k={i.k}: {self.largest_max_context}{capped}")
        return "\n".join(rows)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _precision(i: PlanInputs) -> str:
    q = i.graphs.weights
    return "fp16" if q == "fp32" else f"{q} weights / fp16 activations"


def runtimes(i: PlanInputs) -> tuple[tuple[str, int, bool], ...]:
    """(name, max_batch_size, speculative) of each Edge-LLM runtime the node may hold."""
    b, spec = i.graphs.batch_slots, i.drafter == "eagle3"
    if b == 1:
        return (("LLMRuntime" + (" + EAGLE-3" if spec else ""), 1, spec),)
    if not spec:
        return ((f"RequestEngine (B={b})", b, False),)
    return (("LLMRuntime + EAGLE-3", 1, True), (f"RequestEngine (B={b})", b, False))


def _breakdown(i: PlanInputs, max_context: int) -> tuple[list[tuple[str, int]], int]:
    """(lines, build_peak) for one KV capacity."""
    g, mem, m = i.graphs, i.memory, i.target
    if i.drafter not in ("none", "eagle3"):
        raise ConfigError(f"speculative.drafter={i.drafter}: TensorRT Edge-LLM runs eagle3 or none")
    if i.drafter == "eagle3" and i.head is None:
        raise ConfigError("speculative.drafter=eagle3 needs speculative.eagle3_head")
    weights = weight_bytes(m, g.weights)
    engines = [weights]
    lines: list[tuple[str, int]] = [("embedding table (fp16, outside the engines)", embedding_bytes(m))]
    overhead = int(mem.context_overhead_gb * GIB)
    k_max = max(g.k_values)
    for name, batch, spec in runtimes(i):
        lines.append((f"{name}: target engine weights ({g.weights if g.weights != 'fp32' else 'fp16'})", weights))
        kv = batch * kv_bytes(m, max_context)
        lines.append((f"{name}: paged KV ({batch} x {kv_capacity(max_context)} positions, fp16)", kv))
        rows = batch * (k_max + 1 if spec else 1)  # the tokens whose logits one call selects
        act = activation_bytes(m, max_context, rows)
        if spec:
            h = i.head
            engines.append(head_weight_bytes(h))
            lines.append((f"{name}: EAGLE-3 head weights (Vd={h.draft_vocab_size}, fp16)", engines[-1]))
            lines.append((f"{name}: EAGLE-3 head paged KV", head_kv_bytes(h, max_context)))
            hidden = 3 * m.hidden_size * FP16 * max_context  # the 3 hidden states of the widest call
            lines.append((f"{name}: target hidden states for the head (3 x H)", hidden))
            act = max(act, activation_bytes(h.as_model_config(), max_context, k_max))
        lines.append((f"{name}: activations (estimate)", act))
        if g.max_image_tokens:
            if i.vision is None:
                raise ConfigError("graphs.max_image_tokens needs the target's vision_config (a Qwen-VL checkpoint)")
            engines.append(visual_weight_bytes(i.vision))
            lines.append((f"{name}: visual engine weights (fp16)", engines[-1]))
            lines.append((f"{name}: visual engine activations ({g.max_image_tokens} image tokens)",
                          visual_activation_bytes(i.vision, g.max_image_tokens)))
        lines.append((f"{name}: CUDA + TensorRT context", overhead))
    reserve = int(mem.os_ros_reserve_gb * GIB)
    lines.append(("OS + ROS reserve", reserve))
    # building the largest engine holds its ONNX weights, the engine being built and its serialized copy
    build_peak = 3 * max(engines) + embedding_bytes(m) + overhead + reserve
    return lines, build_peak


def plan(i: PlanInputs, device: DeviceMemory | None = None) -> Plan:
    """The breakdown at graphs.max_context, and the largest max_context that fits.

    The device budget is memory.device_memory_gb, capped by the measured total when `device` is
    given (on Thor: /proc/meminfo MemTotal of the unified memory)."""
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
        if p.largest_max_context >= 16:
            hints.append(f"set graphs.max_context <= {p.largest_max_context}")
        if p.inputs.graphs.weights == "fp32":
            hints.append("or quantize the target (graphs.weights: nvfp4, int4_awq or fp8)")
        if len(runtimes(p.inputs)) > 1:
            hints.append("or set graphs.batch_slots: 1 or speculative.drafter: none (one runtime instead of two)")
    if p.build_peak > p.device:
        hints.append(f"building the largest engine needs {_gib(p.build_peak)}: quantize the target")
    if p.available_now is not None and p.runtime_need > p.available_now:
        hints.append(f"only {_gib(p.available_now)} is free now for {_gib(p.runtime_need)}: stop other "
                     "processes or lower graphs.max_context")
    raise PlanError("memory plan does not fit: " + "; ".join(hints) + "\n" + p.table())


# ---------------------------------------------------------------------------------------------
# Reading the device (not pure; kept apart)


def read_device_memory() -> DeviceMemory | None:
    """The device's memory: a Jetson's unified memory (/proc/meminfo), a discrete GPU's through the CUDA driver
    (meminfo.cuda_memory, no torch), None elsewhere (plan with the config's memory.device_memory_gb)."""
    from spec_edge.device.meminfo import cuda_memory, is_jetson, parse_meminfo

    if is_jetson():
        total, available = parse_meminfo(Path("/proc/meminfo").read_text())
        return DeviceMemory(total, available, "/proc/meminfo, unified")
    if os.environ.get("SPEC_EDGE_NO_CUDA_PROBE") or (found := cuda_memory()) is None:
        return None
    return DeviceMemory(found[0], found[1], "cuda:0 cuMemGetInfo")
