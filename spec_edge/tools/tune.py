"""`spec-edge tune`: choose k from measured costs and measured acceptance, write it into a profile.

    c_step        one target step [1, 1] (ms)                        measured here, interleaved
    c_verify(k)   one target verify [1, k+1] (ms), every exported k    measured here, interleaved
    c_draft       one draft call (ms): 0 for n-gram lookup, a step of the draft / layer-skip runner
    P_i           fraction of verify calls whose draft i was accepted (i = 1..k_max), measured by
                  decoding the user's prompt file once with k_max (acceptance is a prefix property, so
                  the first i positions of a k_max run are what a k = i run would accept)

A verify call at k emits E(k) = 1 + P_1 + ... + P_k tokens (with one acceptance rate a for every
position: (1 - a^(k+1)) / (1 - a)) and costs c_verify(k) + k * c_draft. Drafters that stay silent
(n-gram without a match) leave a share of plain steps, measured in the same run; the expected rate is

    tokens/s(k) = (n_verify * E(k) + n_step) / (n_verify * (c_verify(k) + k * c_draft) + n_step * c_step)

and the tuner picks the k with the highest value (k = 0: no speculation, 1 / c_step).

It also writes serve.speculate_k_by_load, the k per load (spec_edge/speculation_policy.py), one entry
per load n = 1..L: the k (0 = no speculation) with the highest expected total tokens/s at that load.
The serial node (graphs.batch_slots = 1, L = serve.queue_limit): its one worker serves its FIFO queue
one request at a time, so the queue changes neither the plain nor the speculative rate of a request:
from this run every entry is the curve's best k. With --concurrency-json the totals measured through
the ROS service per number of clients decide instead (the k they were measured at where speculation
was at least as fast as plain, else 0). The batched node (L = graphs.batch_slots): the costs of calls
with n rows of every width and the expected rates per occupancy, tools/tune_batch.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.config import DRAFTERS
from spec_edge.tools.acceptance import expected_tokens

# ---------------------------------------------------------------------------------------------
# Pure formulas (tested in test/test_tune.py)


def verify_cost(costs: dict[int, float], k: int) -> float:
    """c_verify(k) from measured widths; between or beyond them a least-squares line in k."""
    if k in costs:
        return costs[k]
    ks = sorted(costs)
    if len(ks) == 1:
        return costs[ks[0]]
    slope, intercept = np.polyfit(ks, [costs[x] for x in ks], 1)
    return float(intercept + slope * k)


@dataclass
class Curve:
    ks: list[int]
    tokens_per_s: list[float]     # expected, per k (k = 0: plain decoding)
    speedup: list[float]          # over plain decoding
    best_k: int


def k_curve(step_ms: float, verify_ms: dict[int, float], p_accept: list[float], ks: list[int],
            draft_ms: float = 0.0, n_verify: float = 1.0, n_step: float = 0.0) -> Curve:
    """Expected tokens/s for each k in ks (plus k = 0, plain), and the best k."""
    plain = 1000.0 / step_ms
    out_ks, rates = [0], [plain]
    for k in sorted(ks):
        tokens = n_verify * expected_tokens(p_accept, k) + n_step
        ms = n_verify * (verify_cost(verify_ms, k) + k * draft_ms) + n_step * step_ms
        out_ks.append(k)
        rates.append(1000.0 * tokens / ms if ms > 0 else 0.0)
    best = out_ks[int(np.argmax(rates))]
    return Curve(ks=out_ks, tokens_per_s=rates, speedup=[r / plain for r in rates], best_k=best)


def curve_text(curve: Curve, title: str = "") -> str:
    lines = [title] if title else []
    lines.append("    k   expected tok/s   speed-up")
    for k, rate, speed in zip(curve.ks, curve.tokens_per_s, curve.speedup):
        mark = "  <- best" if k == curve.best_k else ""
        lines.append(f"  {k:3d}   {rate:14.1f}   {speed:7.2f}x{mark}")
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


def measure_costs(runner, ks: list[int], position: int = 256, rounds: int = 30,
                  extra: dict | None = None) -> dict:
    """Median ms of step[1] and each verify[k+1] on runner, calls interleaved round by round so load
    changes hit every width alike. extra: name -> callable timed the same way (a draft step)."""
    position = min(position, runner.max_context - max(ks, default=1) - 2)
    widths = [1] + [k + 1 for k in sorted(ks) if k + 1 in runner.widths]
    timings: dict[str, list[float]] = {f"w{w}": [] for w in widths}
    for name in (extra or {}):
        timings[name] = []
    calls = {f"w{w}": (lambda w=w: runner.forward(list(range(10, 10 + w)), position)) for w in widths}
    calls.update(extra or {})
    for call in calls.values():  # warm-up
        call()
    for r in range(rounds):
        order = list(calls)
        order = order[r % len(order):] + order[:r % len(order)]
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            timings[name].append((time.perf_counter() - t0) * 1000)
    med = {name: statistics.median(values) for name, values in timings.items()}
    step = med.pop("w1")
    verify = {w - 1: med.pop(f"w{w}") for w in widths if w > 1}
    return {"step_ms": step, "verify_ms": verify, "verify_over_step": {k: v / step for k, v in verify.items()},
            "extra_ms": med, "position": position, "rounds": rounds}


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
    p.add_argument("--concurrency-json", help="results of bench/concurrency.py (total tok/s through the ROS service "
                                              "per number of clients): serve.speculate_k_by_load of the serial "
                                              "node from those instead of from this run's one-request curve")


def main(cfg, args, progress) -> int:
    from spec_edge import config as cfgmod
    from spec_edge.runtime.engine import Engine
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.tools.prompts import load_prompts

    drafter = args.drafter or (cfg.speculative.drafter if cfg.speculative.drafter != "none" else "ngram")
    ks = sorted(set(args.ks or cfg.graphs.k_values))
    batched = cfg.graphs.batch_slots > 1
    if batched and drafter != "ngram":  # tune_batch prices the target's calls per occupancy, not a slot's drafting
        raise cfgmod.ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots}: spec-edge tune prices the batched "
                                 f"node's target calls per occupancy, not drafter {drafter}'s own per-slot cost; "
                                 f"tune it with --drafter ngram")
    # measured with the policy off: the acceptance run verifies k_max drafts whatever table the profile has
    cfg = cfg.replace(**{"graphs.k_values": sorted(set(cfg.graphs.k_values) | set(ks)), "serve.speculate_k_by_load": [],
                         "speculative.drafter": drafter, "speculative.k": max(ks)})
    prompts = load_prompts(Path(args.prompts) if args.prompts else None)
    load = machine_load()
    progress(f"[tune] drafter {drafter}, k candidates {ks}, {len(prompts)} prompts; load {load}")
    engine = Engine.from_config(cfg, progress)
    extra = {}
    if drafter in ("layerskip", "draft"):
        runner = engine.drafter(drafter).runner
        extra["draft"] = lambda: runner.forward([11], 100)
    costs = measure_costs(engine.target, ks, rounds=args.rounds, extra=extra)
    draft_ms = costs["extra_ms"].get("draft", 0.0)
    progress(f"[tune] step[1] {costs['step_ms']:.1f} ms; " + ", ".join(
        f"verify[{k + 1}] {v:.1f} ms ({v / costs['step_ms']:.2f}x)" for k, v in costs["verify_ms"].items())
        + (f"; draft step {draft_ms:.1f} ms" if extra else ""))
    kmax = max(ks)
    accepted_at = [0] * kmax
    n_verify = n_step = 0
    for prompt in prompts:
        result = engine.generate(GenerateRequest(prompt=prompt["prompt"], drafter=drafter, k=kmax,
                                                 max_new_tokens=args.max_new_tokens, temperature=0.0))
        s = result.stats
        n_verify += s.verify_calls
        n_step += s.step_calls
        accepted_at = [a + b for a, b in zip(accepted_at, s.accepted_at)]
    p_accept = [a / n_verify for a in accepted_at] if n_verify else [0.0] * kmax
    progress(f"[tune] {n_verify} verify calls, {n_step} plain steps; acceptance per position "
             + " ".join(f"{p:.2f}" for p in p_accept))
    curve = k_curve(costs["step_ms"], costs["verify_ms"], p_accept, ks, draft_ms,
                    n_verify=n_verify or 1, n_step=n_step)
    text = curve_text(curve, f"k curve ({drafter}, {cfg.runtime.backend}, weights {cfg.graphs.weights})")
    print(text)
    from spec_edge import speculation_policy

    loads, what, bound = speculation_policy.max_load(cfg)
    if batched:  # the batched node: measured costs of calls with n rows per occupancy
        from spec_edge.runtime.backends.onnxruntime import target_graphs
        from spec_edge.runtime.backends.ort_batch import BatchRunner
        from spec_edge.tools import tune_batch

        runner = BatchRunner(target_graphs(cfg, progress), cfg.runtime.threads, slots=cfg.graphs.batch_slots)
        call = tune_batch.forward_call(runner)
        occupancy = tune_batch.occupancy_costs(call, range(1, loads + 1), [runner.step_width] + [k + 1 for k in ks],
                                               rounds=max(3, args.rounds // 3))
        table, rates = tune_batch.k_table(occupancy, range(1, loads + 1), ks, runner.step_width, p_accept,
                                          n_verify / max(n_verify + n_step, 1))
        why = (f"per {what} ({bound}): the k with the highest expected total tok/s from the measured costs of "
               f"calls with n rows (runner.forward, mixed=group) and this run's acceptance\n"
               + tune_batch.table_text(occupancy, rates, table, runner.step_width))
    elif args.concurrency_json:
        data = json.loads(Path(args.concurrency_json).read_text())
        per_depth = {int(row["clients"]): (row["plain_total_tok_s"], row["spec_total_tok_s"]) for row in data["rows"]}
        measured_k = int(data.get("k") or curve.best_k or kmax)
        if measured_k not in ks:
            raise cfgmod.ConfigError(f"{args.concurrency_json} was measured at k={measured_k}: add it to --ks")
        table = table_from_totals(per_depth, measured_k, loads)
        why = (f"per {what} ({bound}): k={measured_k} where speculation was at least as fast as plain through "
               f"the ROS service, else 0 ({depth_text(per_depth)}; {args.concurrency_json})")
    else:  # the serial node serves one request at a time: every load gets the one-request curve's best k
        table = [curve.best_k] * loads
        why = (f"per {what} ({bound}): the node's one worker serves its queue one request at a time, so a "
               f"deeper queue changes neither rate: every load takes the curve's best k")
    best = max(table)
    updates = {"speculative.drafter": drafter if best else "none", "serve.speculate_k_by_load": table}
    if best:
        updates["speculative.k"] = best
    decision = f"serve.speculate_k_by_load = {table} ({speculation_policy.describe(table)}): {why}"
    print(decision)
    tuned = cfg.replace(**updates)
    out = Path(args.out or "config/tuned.yaml")
    header = "\n".join(f"#| {line}" for line in (text + "\n" + decision).splitlines())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by `spec-edge tune` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
                   f"machine load {load['loadavg_1m']} on {load['cpus']} cores\n"
                   f"# step[1] {costs['step_ms']:.1f} ms; acceptance per position "
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
