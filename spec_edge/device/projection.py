"""Choosing k: the decode-speed projection behind `spec-edge plan`'s k table and the speed-up
column of docs/thor_profiles.md.

Bytes read per call -> time, and the expected gain of k drafts per verify. Decode on Thor is
memory-bound: a call reads every weight once (the embedding only by rows) and, with static-shape
graphs, the WHOLE cache of S positions whatever the real length - so max_context costs time on
every step, not only memory. The byte counts are memory.py's (weight_bytes, kv_bytes); the
bandwidth and latency constants are assumptions until `spec-edge bench` measures them.
"""
from __future__ import annotations

from spec_edge.config import ModelConfig
from spec_edge.device.head_memory import head_kv_bytes, head_weight_bytes
from spec_edge.device.memory import DTYPE_BYTES, PlanInputs, kv_bytes, weight_bytes

THOR_BANDWIDTH = 273e9      # bytes/s: Jetson AGX Thor, 256-bit LPDDR5X-8533
BANDWIDTH_EFFICIENCY = 0.75  # fraction of peak a decode step achieves (assumed; `spec-edge bench` measures)
PER_LAYER_LATENCY = 20e-6    # s per layer per call: kernel launches and small-kernel tails (assumed)
VERIFY_OVERHEAD = 1.05       # a k+1 <= 9 wide verify costs ~ one step: the same bytes, more math


def bytes_read_per_call(m: ModelConfig, dtype: str, quantization: str, max_context: int,
                        n_layers: int | None = None) -> int:
    """Weights streamed by one call (layers + head + final norm; the embedding Gather reads only
    T rows) plus the full K and V cache of the layers it runs."""
    layers = m.n_layers if n_layers is None else n_layers
    dt = DTYPE_BYTES[dtype]
    no_embed = weight_bytes(m, dtype, quantization, n_layers=layers, tied_copies=1)
    if not m.tie_embeddings:
        no_embed -= m.vocab_size * m.hidden_size * dt  # untied: the separate head is read, the table is not
    return no_embed + kv_bytes(m, max_context, dtype, n_layers=layers)


def call_seconds(read_bytes: int, n_layers: int, bandwidth: float = THOR_BANDWIDTH) -> float:
    return read_bytes / (bandwidth * BANDWIDTH_EFFICIENCY) + n_layers * PER_LAYER_LATENCY


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify yields with k drafts each accepted with probability alpha (i.i.d.):
    accepted drafts + the target's own token = (1 - alpha**(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Speed relative to plain decoding, draft_cost = draft call time / target step time."""
    return expected_tokens(alpha, k) / (k * draft_cost + VERIFY_OVERHEAD)


EAGLE3_DRAFT_VOCAB = 32000  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's reduced draft vocabulary


def eagle3_head_bytes(m: ModelConfig, dtype: str) -> int:
    """Weights one EAGLE-3 draft step reads: fc (3 hidden -> hidden), one decoder layer whose q/k/v read
    2 hidden (embedding + fused state), its MLP, and the draft-vocabulary head, all in dtype."""
    h, d, dt = m.hidden_size, m.head_dim, DTYPE_BYTES[dtype]
    attn = 2 * h * d * (m.n_heads + 2 * m.n_kv_heads) + m.n_heads * d * h
    return (3 * h * h + attn + 3 * h * m.intermediate_size + EAGLE3_DRAFT_VOCAB * h) * dt


def best_k(alpha: float, draft_cost: float, k_max: int = 8) -> int:
    return max(range(1, k_max + 1), key=lambda k: speedup(alpha, k, draft_cost))


def draft_cost(i: PlanInputs) -> float | None:
    """Draft call time / target step time for the plan's drafter (None: no drafter). ngram
    drafting is a host-side lookup: cost 0."""
    s, dtype, q = i.graphs.max_context, i.graphs.dtype, i.graphs.weights
    target = call_seconds(bytes_read_per_call(i.target, dtype, q, s), i.target.n_layers)
    if i.drafter == "draft" and i.draft is not None:
        return call_seconds(bytes_read_per_call(i.draft, dtype, "fp32", s), i.draft.n_layers) / target
    if i.drafter == "layerskip":
        n = i.graphs.layer_skip_layers
        return call_seconds(bytes_read_per_call(i.target, dtype, q, s, n_layers=n), n) / target
    if i.drafter in ("eagle3", "hybrid") and i.head is not None:
        # a draft step reads every head weight (fc too: the one graph computes fc(0) on a step) and the
        # head's one-layer cache; hybrid: the same when the head drafts (prompt lookup costs nothing)
        head = head_weight_bytes(i.head, DTYPE_BYTES[dtype]) + head_kv_bytes(i.head, s, DTYPE_BYTES[dtype])
        return call_seconds(head, 1) / target
    if i.drafter == "ngram":
        return 0.0
    if i.drafter in ("eagle3", "hybrid"):
        return call_seconds(eagle3_head_bytes(i.target, dtype), 1) / target
    return None


def k_table(i: PlanInputs, alpha: float, k_max: int = 8) -> str:
    """Expected tokens per verify and speed-up for k = 1..k_max at acceptance rate alpha."""
    c = draft_cost(i)
    if c is None:
        return "drafter=none: no speculative decoding"
    s, dtype, q = i.graphs.max_context, i.graphs.dtype, i.graphs.weights
    step = call_seconds(bytes_read_per_call(i.target, dtype, q, s), i.target.n_layers)
    rows = [f"k choice at acceptance alpha={alpha:.2f}: target step ~{step * 1e3:.0f} ms "
            f"(memory-bound model, S={s}), draft call = {c:.3f} x step",
            "   k  tokens/verify  speed-up"]
    best = best_k(alpha, c, k_max)
    for k in range(1, k_max + 1):
        mark = "  <- best" if k == best else ("  <- configured" if k == i.k else "")
        if k == best and k == i.k:
            mark = "  <- best, configured"
        rows.append(f"  {k:2d}  {expected_tokens(alpha, k):13.2f}  {speedup(alpha, k, c):8.2f}x{mark}")
    return "\n".join(rows)
