"""`spec-edge tune`: choose the k per load from measured call costs and measured acceptance, write it
into a profile (serve.speculate_k_by_load, spec_edge/speculation_policy.py; speculative.k its largest).

One model for every graphs.batch_slots B (a request alone is one occupied slot). Measured here, calls
interleaved round by round so load changes on the machine hit every shape alike:

    c(j, w)   ms of one target call with j rows of width w, j = 1..B, w = the step width (1, or 2 for
              q4's two-row step) and every k+1, on the engine's own runner (ort_runner.OrtRunner)
    c_draft   one draft call (ms): 0 for n-gram lookup and the heads, a step of the draft / layer-skip runner
    P_i       share of verify calls whose draft i was accepted (i = 1..k_max), from decoding the prompt file
              once at k_max (acceptance is a prefix property: the first i positions of a k_max run are what
              a k = i run accepts); E(k) = 1 + P_1 + ... + P_k tokens per verify (expected_tokens)
    v         share of a slot's iterations at which its drafter proposed (silent n-gram: plain steps)

With n slots occupied, one iteration is one call for the slots that draft (j rows of width k+1) and one
for those that only step (n - j rows of the step width); with the slots independent:

    tokens(n, k) = n * (v * E(k) + 1 - v)
    ms(n, k)     = sum_j Binom(j; n, v) * (c(j, k+1) + c(n-j, step)) + n * v * k * c_draft     c(0, .) = 0
    rate(n, k)   = 1000 * tokens(n, k) / ms(n, k)          rate(n, 0) = 1000 * n / c(n, step)

(a width without a graph, B = 1: c(1, k+1) from a least-squares line through the measured widths). The
load n of a request (speculation_policy.max_load: requests in the node, itself included) runs
min(n, B) occupied slots, the rest wait: entry n of the table is the k (0 = no speculation) with the
highest rate at that occupancy. With --concurrency-json the totals measured through the ROS service
per number of clients (bench/concurrency.py) decide instead: the k they were measured at where
speculation was at least as fast as plain, else 0.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


from spec_edge.config import DRAFTERS
# the call costs by (rows, width) and their measurement are the runtime's (speculative.k auto weighs them live)
from spec_edge.runtime.k_choice import Call, Costs, forward_call, occupancy_costs, verify_cost

# ---------------------------------------------------------------------------------------------
# Pure formulas (tested in test/test_tune.py)


def expected_tokens(p_accept: Sequence[float], k: int) -> float:
    """1 + P_1 + ... + P_k from measured per-position acceptance (P_i: share of verifies whose first i
    drafts were accepted). Beyond the measured positions the last conditional rate P_n / P_{n-1}
    continues geometrically (one rate at every position: device/projection.expected_tokens)."""
    p = [min(max(float(x), 0.0), 1.0) for x in p_accept]
    total = 1.0
    for i in range(k):
        if i < len(p):
            total += p[i]
        elif p:
            ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else p[-1]
            total += p[-1] * ratio ** (i - len(p) + 1)
    return total


def rate(costs: Costs, n: int, k: int, step_width: int, p_accept: Sequence[float], verify_share: float,
         draft_ms: float = 0.0) -> float:
    """Expected total tokens/s of n occupied slots at k (0: plain steps)."""
    if k == 0:
        return 1000.0 * n / costs[(n, step_width)]
    v = min(max(verify_share, 0.0), 1.0)
    tokens = n * (v * expected_tokens(list(p_accept), k) + 1.0 - v)
    ms = n * v * k * draft_ms
    for j in range(n + 1):
        share = math.comb(n, j) * v ** j * (1.0 - v) ** (n - j)
        ms += share * ((costs[(j, k + 1)] if j else 0.0) + (costs[(n - j, step_width)] if n - j else 0.0))
    return 1000.0 * tokens / ms


def k_table(costs: Costs, occupancies: Sequence[int], ks: Sequence[int], step_width: int, p_accept: Sequence[float],
            verify_share: float, draft_ms: float = 0.0) -> tuple[list[int], dict[int, dict[int, float]]]:
    """(the best k per occupancy, in order; occupancy -> {k: expected tokens/s}, k = 0 included)."""
    rates = {n: {k: rate(costs, n, k, step_width, p_accept, verify_share, draft_ms) for k in [0, *sorted(ks)]}
             for n in occupancies}
    return [max(rates[n], key=lambda k: (rates[n][k], -k)) for n in occupancies], rates


def table_for_loads(best_by_occupancy: Sequence[int], loads: int) -> list[int]:
    """serve.speculate_k_by_load: load n runs min(n, B) occupied slots (B = len(best_by_occupancy))."""
    return [best_by_occupancy[min(n, len(best_by_occupancy)) - 1] for n in range(1, loads + 1)]


@dataclass
class Curve:
    ks: list[int]
    tokens_per_s: list[float]     # expected, per k (k = 0: plain decoding)
    speedup: list[float]          # over plain decoding
    best_k: int


def curve_of(rates: dict[int, float]) -> Curve:
    """The curve of one occupancy's rates {k: tokens/s}."""
    ks = sorted(rates)
    values = [rates[k] for k in ks]
    best = max(ks, key=lambda k: (rates[k], -k))
    return Curve(ks=ks, tokens_per_s=values, speedup=[r / rates[0] for r in values], best_k=best)


def k_curve(step_ms: float, verify_ms: dict[int, float], p_accept: list[float], ks: list[int],
            draft_ms: float = 0.0, n_verify: float = 1.0, n_step: float = 0.0) -> Curve:
    """One request alone (one slot): expected tokens/s for each k in ks plus k = 0, from its step cost, the
    verify costs measured per k and counts of verify calls and plain steps."""
    costs = {(1, 1): step_ms} | {(1, k + 1): verify_cost(verify_ms, k) for k in ks}
    return curve_of(k_table(costs, [1], ks, 1, p_accept, n_verify / (n_verify + n_step), draft_ms)[1][1])


def curve_text(curve: Curve, title: str = "") -> str:
    lines = [title] if title else []
    lines.append("    k   expected tok/s   speed-up")
    for k, value, speed in zip(curve.ks, curve.tokens_per_s, curve.speedup):
        mark = "  <- best" if k == curve.best_k else ""
        lines.append(f"  {k:3d}   {value:14.1f}   {speed:7.2f}x{mark}")
    return "\n".join(lines)


def table_text(costs: Costs, rates: dict[int, dict[int, float]], best: list[int], step_width: int) -> str:
    """The per-occupancy costs, rates and choices, as printed and written into the profile's header."""
    ks = sorted(next(iter(rates.values())))
    lines = ["  slots   step ms  " + "".join(f" verify[{k + 1}] ms" for k in ks if k)
             + "".join(f"   k={k} tok/s" for k in ks) + "   chosen k"]
    for n, chosen in zip(sorted(rates), best):
        lines.append(f"  {n:5d}  {costs[(n, step_width)]:8.1f}  "
                     + "".join(f" {costs[(n, k + 1)]:12.1f}" for k in ks if k)
                     + "".join(f" {rates[n][k]:11.1f}" for k in ks) + f"   {chosen:7d}")
    return "\n".join(lines)


def table_from_totals(per_depth: dict[int, tuple[float, float]], k: int, loads: int) -> list[int]:
    """serve.speculate_k_by_load for loads 1..loads from measured total tokens/s (plain, speculative at k)
    per number of requests at once: k where speculation was at least as fast, else 0; a load between
    measured depths takes the deepest measured depth below it (the shallowest for loads below all)."""
    depths = sorted(per_depth)
    table = []
    for n in range(1, loads + 1):
        depth = max((d for d in depths if d <= n), default=depths[0])
        plain, spec = per_depth[depth]
        table.append(k if spec >= plain else 0)
    return table


def depth_text(per_depth: dict[int, tuple[float, float]]) -> str:
    return "; ".join(f"{d} at once: plain {p:.1f}, speculative {s:.1f} tok/s"
                     for d, (p, s) in sorted(per_depth.items()))


# ---------------------------------------------------------------------------------------------
# Measurements


def one_row_call(runner, position: int = 256) -> Call:
    """call(1, width) on a B=1 Runner: width tokens at position (the cache rows below it as they are)."""
    position = min(position, runner.max_context - max(runner.widths) - 2)

    def call(rows: int, width: int):
        assert rows == 1, "a B=1 runner runs one row"
        return runner.forward(list(range(10, 10 + width)), position)
    return call


def measure_costs(runner, ks: list[int], position: int = 256, rounds: int = 30) -> dict:
    """Median ms of step[1] and each exported verify[k+1] on a B=1 runner (spec-edge bench's cost table)."""
    widths = [1] + [k + 1 for k in sorted(ks) if k + 1 in runner.widths]
    costs, _ = occupancy_costs(one_row_call(runner, position), [1], widths, rounds)
    step = costs[(1, 1)]
    verify = {w - 1: costs[(1, w)] for w in widths if w > 1}
    return {"step_ms": step, "verify_ms": verify, "verify_over_step": {k: v / step for k, v in verify.items()},
            "position": position, "rounds": rounds}


def machine_load() -> dict:
    import os

    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------
# CLI


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="prompt file (.jsonl with 'prompt' [and 'kind'] per line, or plain text, one "
                                     "prompt per line); default: bench/prompts.jsonl")
    p.add_argument("--drafter", choices=DRAFTERS[1:], help="default: the profile's")
    p.add_argument("--ks", type=int, nargs="+", help="candidate k values (default: graphs.k_values); each needs "
                                                     "a verify graph (they are exported when missing)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=30, help="timing rounds per call shape")
    p.add_argument("--out", help="profile to write (default: config/tuned.yaml)")
    p.add_argument("--plot", help="PNG of the curve (default: <out>.png)")
    p.add_argument("--concurrency-json", help="results of bench/concurrency.py --drafters none <drafter> (total tok/s "
                                              "through the ROS service per number of clients): the table from "
                                              "those instead of from this run's costs")


def main(cfg, args, progress) -> int:
    from spec_edge import config as cfgmod
    from spec_edge import speculation_policy
    from spec_edge import artifacts
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one
    from spec_edge.tools.prompts import load_prompts

    drafter = args.drafter or (cfg.speculative.drafter if cfg.speculative.drafter != "none" else "ngram")
    ks = sorted(set(args.ks or cfg.graphs.k_values))
    slots = cfg.graphs.batch_slots
    # measured with the policy off: the acceptance run verifies k_max drafts whatever table the profile has
    cfg = cfg.replace(**{"graphs.k_values": sorted(set(cfg.graphs.k_values) | set(ks)), "serve.speculate_k_by_load": [],
                         "speculative.drafter": drafter, "speculative.k": max(ks)})
    prompts = load_prompts(Path(args.prompts) if args.prompts else None)
    load = machine_load()
    progress(f"[tune] drafter {drafter}, k candidates {ks}, {slots} slot(s), {len(prompts)} prompts; load {load}")
    engine = artifacts.engine(cfg, progress)
    call, step_width = forward_call(engine.runner), engine.runner.step_width  # the engine's own runner
    extra = {}
    if drafter in ("layerskip", "draft"):
        draft_runner = engine.drafter(drafter).runner
        extra["draft"] = lambda: draft_runner.forward([11], 100)
    costs, extra_ms = occupancy_costs(call, range(1, slots + 1), [step_width] + [k + 1 for k in ks],
                                      rounds=args.rounds, extra=extra)
    draft_ms = extra_ms.get("draft", 0.0)
    kmax = max(ks)
    accepted_at = [0] * kmax
    n_verify = n_step = 0
    for prompt in prompts:
        result = run_one(engine, GenerateRequest(prompt=prompt["prompt"], drafter=drafter, k=kmax,
                                                 max_new_tokens=args.max_new_tokens, temperature=0.0))
        s = result.stats
        n_verify += s.verify_calls
        n_step += s.step_calls
        accepted_at = [a + b for a, b in zip(accepted_at, s.accepted_at)]
    p_accept = [a / n_verify for a in accepted_at] if n_verify else [0.0] * kmax
    verify_share = n_verify / max(n_verify + n_step, 1)
    progress(f"[tune] {n_verify} verify calls, {n_step} plain steps; acceptance per position "
             + " ".join(f"{p:.2f}" for p in p_accept) + (f"; draft step {draft_ms:.1f} ms" if extra else ""))
    best, rates = k_table(costs, range(1, slots + 1), ks, step_width, p_accept, verify_share, draft_ms)
    curve = curve_of(rates[1])
    text = (curve_text(curve, f"k curve, one request ({drafter}, {cfg.runtime.backend}, weights {cfg.graphs.weights})")
            + "\n" + table_text(costs, rates, best, step_width))
    print(text)
    loads, what, bound = speculation_policy.max_load(cfg)
    if args.concurrency_json:
        data = json.loads(Path(args.concurrency_json).read_text())
        per_depth = {int(row["clients"]): (row["plain_total_tok_s"], row["spec_total_tok_s"]) for row in data["rows"]}
        measured_k = int(data.get("k") or curve.best_k or kmax)
        if measured_k not in ks:
            raise cfgmod.ConfigError(f"{args.concurrency_json} was measured at k={measured_k}: add it to --ks")
        table = table_from_totals(per_depth, measured_k, loads)
        why = (f"per {what} ({bound}): k={measured_k} where speculation was at least as fast as plain through "
               f"the ROS service, else 0 ({depth_text(per_depth)}; {args.concurrency_json})")
    else:
        table = table_for_loads(best, loads)
        why = (f"per {what} ({bound}): load n runs min(n, {slots}) occupied slot(s); the k with the highest expected "
               f"total tok/s at that occupancy from the measured costs of calls with j rows and this run's acceptance")
    top = max(table)
    updates = {"speculative.drafter": drafter if top else "none", "serve.speculate_k_by_load": table}
    if top:
        updates["speculative.k"] = top
    decision = f"serve.speculate_k_by_load = {table} ({speculation_policy.describe(table)}): {why}"
    print(decision)
    tuned = cfg.replace(**updates)
    out = Path(args.out or "config/tuned.yaml")
    header = "\n".join(f"#| {line}" for line in (text + "\n" + decision).splitlines())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by `spec-edge tune` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
                   f"machine load {load['loadavg_1m']} on {load['cpus']} cores\n"
                   f"# one slot: step {costs[(1, step_width)]:.1f} ms; acceptance per position "
                   f"{' '.join(f'{p:.2f}' for p in p_accept)}\n{header}\n" + cfgmod.dump(tuned))
    progress(f"[tune] wrote {out} (speculative.k = {tuned.speculative.k}, serve.speculate_k_by_load = {table})")
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    if _plot(curve, plot, f"{drafter} on {cfg.runtime.backend} ({cfg.graphs.weights})"):
        progress(f"[tune] curve: {plot}")
    return 0


def _plot(curve: Curve, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[tune] matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(curve.ks, curve.tokens_per_s, marker="o")
    ax.axhline(curve.tokens_per_s[0], ls="--", c="grey", lw=0.8, label="plain (k=0)")
    ax.set_xlabel("k (drafts per verify)")
    ax.set_ylabel("expected tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
