"""Tokens per verify call from measured acceptance: the formula tools/tune.py (B = 1) and
tools/tune_batch.py (per occupancy) both price a k with (one rate at every position, i.i.d.:
device/projection.expected_tokens)."""
from __future__ import annotations


def expected_tokens(p_accept: list[float], k: int) -> float:
    """1 + P_1 + ... + P_k from measured per-position acceptance (P_i: share of verifies whose first i
    drafts were accepted). Beyond the measured positions the last conditional rate P_n / P_{n-1}
    continues geometrically."""
    p = [min(max(float(x), 0.0), 1.0) for x in p_accept]
    total = 1.0
    for i in range(k):
        if i < len(p):
            total += p[i]
        elif p:
            ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else p[-1]
            total += p[-1] * ratio ** (i - len(p) + 1)
    return total
