"""`spec-edge tune` for graphs.batch_slots > 1: the k of every occupancy (serve.speculate_k_by_load).

With n of the B slots occupied, one iteration of runtime/speculative.py (mixed="group") is one call for the
slots that draft (j rows of width k+1) and one for the slots that only step (n - j rows of the step
width: 1, or 2 for q4's two-row step). Measured here, calls interleaved round by round:

    c(j, w)   ms of one call with j rows of width w, j = 1..B, w = the step width and every k+1

(the runner runs only the j slots it is given, ort_batch.BatchRunner: one slot the B=1 graphs, j >= 2
the graph of the smallest exported row count >= j; the call is a parameter, `call(j, width)`, so
any runner with that contract is measured the same way). From the tuner's own acceptance run at the largest k (P_i: share of verify calls whose
draft i was accepted, E(k) = 1 + P_1 + .. + P_k tokens per verify; v: share of a slot's iterations
at which its drafter proposed, 1 - v plain steps), with the slots independent:

    tokens(n, k) = n * (v * E(k) + 1 - v)
    ms(n, k)     = sum_j Binom(j; n, v) * (c(j, k+1) + c(n-j, step))        c(0, .) = 0
    rate(n, k)   = 1000 * tokens(n, k) / ms(n, k)          rate(n, 0) = 1000 * n / c(n, step)

and the entry of load n is the k (0 = no speculation) with the highest expected total tokens/s.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from spec_edge.tools.acceptance import expected_tokens

Call = Callable[[int, int], object]  # call(rows, width): one decode call with that many rows


def forward_call(runner, position: int = 128) -> Call:
    """call(j, width) on a BatchRunner: greedy ids of slots 0..j-1, every slot's cache prefilled to position."""
    batch = runner.batch
    position = min(position, runner.max_context - max(runner.widths) - 1)
    runner.held = [()] * batch  # the calls below rewrite every region
    for slot in range(batch):
        runner.prefill(slot, list(range(10, 10 + position)), 0)
    tokens = {width: np.full((batch, width), 11, np.int64) for width in runner.widths}

    def call(rows: int, width: int):
        return runner.argmax(list(range(rows)), tokens[width][:rows], [position] * rows)
    return call


def occupancy_costs(call: Call, loads: Sequence[int], widths: Sequence[int],
                    rounds: int = 10) -> dict[tuple[int, int], float]:
    """(rows j, width w) -> median ms of call(j, w), for every j in loads and w in widths."""
    keys = [(rows, width) for rows in loads for width in sorted(set(widths))]
    times: dict[tuple[int, int], list[float]] = {key: [] for key in keys}
    for key in keys:  # warm-up
        call(*key)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            call(*key)
            times[key].append((time.perf_counter() - t0) * 1000)
    return {key: statistics.median(values) for key, values in times.items()}


def rate(costs: dict[tuple[int, int], float], n: int, k: int, step_width: int, p_accept: Sequence[float],
         verify_share: float) -> float:
    """Expected total tokens/s of n occupied slots at k (0: plain steps), from occupancy_costs."""
    if k == 0:
        return 1000.0 * n / costs[(n, step_width)]
    v = min(max(verify_share, 0.0), 1.0)
    tokens = n * (v * expected_tokens(list(p_accept), k) + 1.0 - v)
    ms = 0.0
    for j in range(n + 1):
        share = math.comb(n, j) * v ** j * (1.0 - v) ** (n - j)
        ms += share * ((costs[(j, k + 1)] if j else 0.0) + (costs[(n - j, step_width)] if n - j else 0.0))
    return 1000.0 * tokens / ms


def k_table(costs: dict[tuple[int, int], float], loads: Sequence[int], ks: Sequence[int], step_width: int,
            p_accept: Sequence[float], verify_share: float) -> tuple[list[int], dict[int, dict[int, float]]]:
    """(the best k per load, in load order; load -> {k: expected tokens/s}, k = 0 included)."""
    rates = {n: {k: rate(costs, n, k, step_width, p_accept, verify_share) for k in [0, *sorted(ks)]} for n in loads}
    return [max(rates[n], key=lambda k: (rates[n][k], -k)) for n in loads], rates


def table_text(costs: dict[tuple[int, int], float], rates: dict[int, dict[int, float]], table: list[int],
               step_width: int) -> str:
    """The per-load table as printed and written into the profile's header."""
    ks = sorted(next(iter(rates.values())))
    lines = ["  load   step ms  " + "".join(f" verify[{k + 1}] ms" for k in ks if k)
             + "".join(f"   k={k} tok/s" for k in ks) + "   chosen k"]
    for n, chosen in zip(sorted(rates), table):
        lines.append(f"  {n:4d}  {costs[(n, step_width)]:8.1f}  "
                     + "".join(f" {costs[(n, k + 1)]:12.1f}" for k in ks if k)
                     + "".join(f" {rates[n][k]:11.1f}" for k in ks) + f"   {chosen:7d}")
    return "\n".join(lines)
