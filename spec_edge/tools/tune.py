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

It also writes serve.speculate_max_queue, the queue depth above which the node runs a request
target-only. The node's one worker serves its FIFO queue one request at a time, so a deeper queue
changes neither the plain nor the speculative rate of a request: from this run's one-request rates
the value is 0 (never switch off) when the best k beats plain, else 1 (speculate only alone). With
--concurrency-json the rates measured through the ROS service per number of clients decide instead.
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

# ---------------------------------------------------------------------------------------------
# Pure formulas (tested in test/test_tune.py)


def expected_tokens_geometric(alpha: float, k: int) -> float:
    """Tokens per verify call when every draft is accepted with probability alpha independently."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


def speculate_max_queue(per_depth: dict[int, tuple[float, float]]) -> int:
    """From measured total tokens/s (plain, speculative) per number of concurrent requests: the largest
    depth up to which speculation is never slower than plain. 0 = speculation always pays (never switch
    off); it is the deepest load at which the speculative total is still >= plain, when a deeper load
    measured slower."""
    depths = sorted(per_depth)
    worse = [d for d in depths if per_depth[d][1] < per_depth[d][0]]
    if not worse:
        return 0
    first_bad = worse[0]
    ok = [d for d in depths if d < first_bad]
    return max(ok) if ok else 1


def queue_rule(per_depth: dict[int, tuple[float, float]]) -> tuple[int, str]:
    """serve.speculate_max_queue from (plain, speculative) tokens/s per number of requests queued at
    once (speculate_max_queue's rule), and why, in words. The node compares it with the requests
    queued as a request starts, that one included: above it the request runs target-only."""
    value = speculate_max_queue(per_depth)
    depths = sorted(per_depth)
    worse = [d for d in depths if per_depth[d][1] < per_depth[d][0]]
    if value == 0 and depths == [1]:
        why = ("speculation is faster than plain on one request, and the node's one worker serves its queue one "
               "request at a time, so a deeper queue changes neither speed: never switch off")
    elif value == 0:
        why = "speculation was at least as fast as plain at every measured depth: never switch off"
    elif worse[0] == depths[0]:
        why = (f"speculation was slower than plain already at {depths[0]} request(s) at once: a request "
               f"speculates only when it starts alone")
    else:
        why = (f"speculation stopped paying at {worse[0]} requests at once: a request that starts with more than "
               f"{value} queued runs target-only")
    return value, why


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
                                              "per number of clients): serve.speculate_max_queue from those "
                                              "instead of from this run's one-request curve")


def main(cfg, args, progress) -> int:
    from spec_edge import config as cfgmod
    from spec_edge.runtime.engine import Engine
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.tools.prompts import load_prompts

    drafter = args.drafter or (cfg.speculative.drafter if cfg.speculative.drafter != "none" else "ngram")
    ks = sorted(set(args.ks or cfg.graphs.k_values))
    cfg = cfg.replace(**{"graphs.k_values": sorted(set(cfg.graphs.k_values) | set(ks)),
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
    best = curve.best_k
    updates = {"speculative.drafter": drafter if best else "none"}
    if best:
        updates["speculative.k"] = best
    if args.concurrency_json:
        data = json.loads(Path(args.concurrency_json).read_text())
        per_depth = {int(row["clients"]): (row["plain_total_tok_s"], row["spec_total_tok_s"]) for row in data["rows"]}
        source = f"{args.concurrency_json}, through the ROS service"
    elif cfg.graphs.batch_slots > 1:  # the batched node: measured (B, 1) / (B, k+1) costs per occupancy
        from spec_edge.graphs.batch_export import batch_graphs
        from spec_edge.runtime.backends.ort_batch import BatchRunner
        from spec_edge.tools import tune_batch

        k = best or cfg.speculative.k
        occupancy = tune_batch.occupancy_costs(BatchRunner(batch_graphs(cfg, progress)), k, rounds=max(3, args.rounds // 3))
        tokens = (n_verify * expected_tokens(p_accept, k) + n_step) / max(n_verify + n_step, 1)
        per_depth = tune_batch.occupancy_rates(occupancy, tokens)
        source = (f"{cfg.graphs.batch_slots} batch slots, k={k}, measured step / verify ms per occupancy "
                  + ", ".join(f"{n}: {s:.1f} / {v:.1f}" for n, (s, v) in occupancy.items()))
    else:  # one request: plain (k = 0) against the best speculative k of the curve above
        per_depth = {1: (curve.tokens_per_s[0], max(curve.tokens_per_s[1:]))}
        source = "the expected rates of the curve above"
    max_queue, why = queue_rule(per_depth)
    if cfg.graphs.batch_slots > 1:  # the batched node counts occupied slots, not queued requests
        why = (f"drafting stopped paying at {min(d for d in per_depth if per_depth[d][1] < per_depth[d][0])} occupied "
               f"slots: with more than {max_queue} occupied an iteration does not draft" if max_queue
               else "drafting paid at every occupancy: always speculate")
    updates["serve.speculate_max_queue"] = max_queue
    decision = f"serve.speculate_max_queue = {max_queue}: {why} ({depth_text(per_depth)}; from {source})"
    print(decision)
    tuned = cfg.replace(**updates)
    out = Path(args.out or "config/tuned.yaml")
    header = "\n".join(f"#| {line}" for line in (text + "\n" + decision).splitlines())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by `spec-edge tune` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
                   f"machine load {load['loadavg_1m']} on {load['cpus']} cores\n"
                   f"# step[1] {costs['step_ms']:.1f} ms; acceptance per position "
                   f"{' '.join(f'{p:.2f}' for p in p_accept)}\n{header}\n" + cfgmod.dump(tuned))
    progress(f"[tune] wrote {out} (k = {best}, serve.speculate_max_queue = {max_queue})")
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
