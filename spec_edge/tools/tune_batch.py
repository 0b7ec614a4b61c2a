"""`spec-edge tune` for graphs.batch_slots > 1: at which occupancy speculation stops paying.

With n of the B slots occupied, one iteration is one call over all slots (runtime/batch.py): a
(B, 1) step or a (B, k+1) verify (one occupied slot: the B=1 graphs bound to it). Measured here per
occupancy n, calls interleaved: c_step(n), c_verify(n). With the acceptance of the tuner's own run
(E(k) tokens per verify, a share of plain steps where the drafter stays silent), the expected totals
for n requests at once are

    plain(n) = n / c_step(n)      speculative(n) = n * (n_verify * E(k) + n_step) / (n_verify + n_step) / c_verify(n)

and serve.speculate_max_queue (for the batched node: the most occupied slots at which an iteration
still drafts) is tune.speculate_max_queue over those per-occupancy rates.
"""
from __future__ import annotations

import statistics
import time

import numpy as np


def occupancy_costs(runner, k: int, rounds: int = 10, position: int = 128) -> dict[int, tuple[float, float]]:
    """occupancy n -> (c_step ms, c_verify ms) on a BatchRunner, n = 1 .. B, interleaved by round."""
    batch, step_width = runner.batch, runner.step_width
    position = min(position, runner.max_context - k - 2)
    for slot in range(batch):
        runner.prefill(slot, list(range(10, 10 + position)), 0)
    calls = {}
    for n in range(1, batch + 1):
        active = [slot < n for slot in range(batch)]
        for width in (step_width, k + 1):
            tokens = np.full((batch, width), 11, np.int64)
            calls[(n, width)] = (lambda tokens=tokens, active=active: runner.forward(tokens, [position] * batch, active))
    times: dict = {key: [] for key in calls}
    for call in calls.values():
        call()
    for r in range(rounds):
        keys = list(calls)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            calls[key]()
            times[key].append((time.perf_counter() - t0) * 1000)
    return {n: (statistics.median(times[(n, step_width)]), statistics.median(times[(n, k + 1)]))
            for n in range(1, batch + 1)}


def occupancy_rates(costs: dict[int, tuple[float, float]], tokens: float) -> dict[int, tuple[float, float]]:
    """occupancy n -> (plain, speculative) expected total tokens/s, from occupancy_costs' ms and the
    tokens one slot emits per speculative iteration, (n_verify * E(k) + n_step) / (n_verify + n_step)."""
    return {n: (1000.0 * n / step, 1000.0 * n * tokens / verify) for n, (step, verify) in costs.items()}
