"""Choosing k: the decode-speed projection behind `spec-edge plan`'s k table and the speed-up
column of docs/thor_profiles.md.

Bytes read per call -> time, and the expected gain of k drafts per verify. Decode on Thor is
memory-bound: a call reads every engine weight once (the embedding only by rows) and the paged KV of
the positions in use; the k table takes the cache full (graphs.max_context positions: the slowest
step, an upper bound). The byte counts are memory.py's; the bandwidth and latency constants are
assumptions until the device check (scripts/thor_check.sh) measures them.
"""
from __future__ import annotations

from spec_edge.config import ModelConfig
from spec_edge.device.memory import PlanInputs, head_kv_bytes, head_weight_bytes, kv_bytes, weight_bytes

THOR_BANDWIDTH = 273e9      # bytes/s: Jetson AGX Thor, 256-bit LPDDR5X-8533
BANDWIDTH_EFFICIENCY = 0.75  # fraction of peak a decode step achieves (assumed)
PER_LAYER_LATENCY = 20e-6    # s per layer per call: kernel launches and small-kernel tails (assumed)
VERIFY_OVERHEAD = 1.05       # a k+1 <= 9 wide verify costs ~ one step: the same bytes, more math


def bytes_read_per_call(m: ModelConfig, quantization: str, context: int, n_layers: int | None = None) -> int:
    """Engine weights streamed by one call (layers, final norm, lm_head) plus the K and V of `context`
    positions of the layers it runs."""
    return weight_bytes(m, quantization, n_layers=n_layers) + kv_bytes(m, context, n_layers=n_layers)


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


def best_k(alpha: float, draft_cost: float, k_max: int = 8) -> int:
    return max(range(1, k_max + 1), key=lambda k: speedup(alpha, k, draft_cost))


def draft_cost(i: PlanInputs) -> float | None:
    """Draft call time / target step time for the plan's drafter (None: no drafter): an EAGLE-3 draft
    step reads every head weight and the head's one-layer cache."""
    if i.drafter != "eagle3" or i.head is None:
        return None
    s, q = i.graphs.max_context, i.graphs.weights
    target = call_seconds(bytes_read_per_call(i.target, q, s), i.target.n_layers)
    return call_seconds(head_weight_bytes(i.head) + head_kv_bytes(i.head, s), 1) / target


def k_table(i: PlanInputs, alpha: float, k_max: int = 8) -> str:
    """Expected tokens per verify and speed-up for k = 1..k_max at acceptance rate alpha."""
    c = draft_cost(i)
    if c is None:
        return "drafter=none: no speculative decoding"
    s, q = i.graphs.max_context, i.graphs.weights
    step = call_seconds(bytes_read_per_call(i.target, q, s), i.target.n_layers)
    rows = [f"k choice at acceptance alpha={alpha:.2f}: target step ~{step * 1e3:.0f} ms "
            f"(memory-bound model, cache full at S={s}), draft call = {c:.3f} x step",
            "   k  tokens/verify  speed-up"]
    best = best_k(alpha, c, k_max)
    for k in range(1, k_max + 1):
        mark = "  <- best" if k == best else ("  <- configured" if k == i.k else "")
        if k == best and k == i.k:
            mark = "  <- best, configured"
        rows.append(f"  {k:2d}  {expected_tokens(alpha, k):13.2f}  {speedup(alpha, k, c):8.2f}x{mark}")
    return "\n".join(rows)
