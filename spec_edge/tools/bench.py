"""`spec-edge bench`: this engine against itself, same weights, same prompts, one run: target-only, and
every drafter x k, for each graphs.weights asked (fp32, q4 ...). The peers (llama.cpp, transformers) join
the same run loop from a script outside the package, bench/peers.py, through main's `peers`.

Interleaving: for every repeat, prompt and temperature, every system runs once, in an order rotated
each round, so load on this shared machine hits all systems alike; speed is reported as the median
over repeats and as ratios taken within a round (to the same round's target-only run).

Exactness (temperature 0): each speculative run must give the token ids of the target-only greedy run
with the same weights; a peer's run is compared with its own plain greedy run and with spec_edge's
fp32 target-only run. A mismatch is flagged with the first differing token and the fp32 target's
top-2 logit margin there (~1e-5: a near-tie, numerics; larger: a real difference).

Outputs: a table on stdout, JSON (--json-out) and a PNG (tok/s vs k per drafter; speed-up per prompt
kind per system). The default is the quick mode (one prompt per kind, temperature 0, one repeat, the
profile's k values): about two minutes here. --full runs every prompt, temperatures 0 / 0.7 / 1.0,
three repeats.

This module is the interleaved run loop (main); spec_edge.tools.systems builds spec_edge's systems,
spec_edge.tools.report the summary, the table and the plot.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from spec_edge.runtime.serving import front_of
from spec_edge.config import AUTO_K
from spec_edge.tools.prompts import load_prompts
from spec_edge.tools.report import format_report, plot, summarize
from spec_edge.tools.systems import INEXACT_VARIANTS, Run, System, spec_systems

# peers(cfg, ks, eos_ids, progress) -> (their systems, notes): what a script outside the package adds to the run
Peers = Callable[..., tuple[list[System], list[str]]]


def machine_load() -> dict:
    """The load averages and core count, printed and written with every measurement."""
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": os.cpu_count()}


def one_row_costs(runner, ks) -> dict:
    """ms of one row's step and each verify[k+1] the runner has, from the engine's own cost measurement
    (runtime/k_choice.measure_costs: what speculative.k auto weighs)."""
    from spec_edge.runtime import k_choice

    costs, width = k_choice.measure_costs(runner), runner.step_width
    step = costs.cost(1, width, width)
    verify = {k: costs.cost(1, k + 1, width) for k in ks if k + 1 in runner.widths and k + 1 != width}
    return {"step_ms": step, "verify_ms": verify, "verify_over_step": {k: v / step for k, v in verify.items()}}


def main(cfg, args, progress, peers: Peers | None = None) -> int:
    full = getattr(args, "full", False)
    temperatures = getattr(args, "temperatures", None) or ([0.0, 0.7, 1.0] if full else [0.0])
    repeats = args.repeats or (3 if full else 1)
    asked = args.ks or [*cfg.graphs.k_values, *([AUTO_K] if cfg.speculative.k == AUTO_K else [])]
    auto = AUTO_K in asked  # also each drafter with speculative.k auto (k chosen per iteration, runtime/k_choice.py)
    ks = sorted({k for k in asked if k != AUTO_K} or set(cfg.graphs.k_values))
    fixed = [k for k in ks if k in asked]
    weights = getattr(args, "weights", None) or (["fp32", "q4"] if full else [cfg.graphs.weights])
    prompts = load_prompts(Path(args.prompts) if getattr(args, "prompts", None) else None, args.kinds, quick=not full)
    max_new = args.max_new_tokens
    seed0 = 1234
    if set(ks) - set(cfg.graphs.k_values):
        cfg = cfg.replace(**{"graphs.k_values": sorted(set(cfg.graphs.k_values) | set(ks))})
    load_start = machine_load()
    progress(f"[bench] {'full' if full else 'quick'} mode: {len(prompts)} prompts, k {fixed + ([AUTO_K] if auto else [])}, "
             f"drafters {args.drafters}, "
             f"weights {weights}, temperatures {temperatures}, {repeats} repeat(s), max_new_tokens {max_new}; "
             f"load {load_start}")
    notes: list[str] = []
    attentions = tuple(getattr(args, "ort_attention", None) or [cfg.graphs.ort_attention])
    systems, engines = spec_systems(cfg, weights, list(args.drafters), fixed, progress, attentions, auto)
    ref_engine = engines.get("fp32") or next(iter(engines.values()))
    eos_ids = tuple(ref_engine.eos_ids)
    from spec_edge.runtime.requests import GenerateRequest

    prompt_ids = {p["id"]: front_of(ref_engine).prompt_ids(GenerateRequest(prompt=p["prompt"])) for p in prompts}
    if peers is not None:
        extra, more = peers(cfg, ks, eos_ids, progress)
        systems += extra
        notes += more
    for note in notes:
        progress(f"[bench] {note}")

    # cost of one verify[k+1] call vs one step call, per weights
    costs = {}
    for w, engine in engines.items():
        costs[w] = one_row_costs(engine.runner, ks)
        progress(f"[bench] spec_edge[{w}] step {costs[w]['step_ms']:.1f} ms; " + ", ".join(
            f"verify[{k + 1}] {v:.1f} ms = {costs[w]['verify_over_step'][k]:.2f} steps"
            for k, v in costs[w]["verify_ms"].items()))

    # warm-up: one short run of every system (first-call allocations, lazy init)
    for system in systems:
        system.run(prompts[0], prompt_ids[prompts[0]["id"]], 0.0, seed0, 8)

    runs: list[Run] = []
    plan = [(r, p, t) for r in range(repeats) for p in prompts for t in temperatures]
    started = time.monotonic()
    for i, (rep, prompt, temp) in enumerate(plan):
        active = [s for s in systems if temp == 0.0 or s.temperatures]
        shift = i % len(active)
        for system in active[shift:] + active[:shift]:
            run = system.run(prompt, prompt_ids[prompt["id"]], temp, seed0 + rep, max_new)
            run.system, run.repeat = system.name, rep
            runs.append(run)
        if args.json_out:  # the runs so far, in case a long run is stopped
            Path(f"{args.json_out}.partial").write_text(json.dumps([asdict(r) for r in runs]))
        progress(f"[bench] round {i + 1}/{len(plan)} ({prompt['id']}, T={temp}, repeat {rep}) "
                 f"{time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.2f}")
    load_end = machine_load()
    report = summarize(systems, runs, prompts, prompt_ids, engines, costs, temperatures)
    report.update(mode="full" if full else "quick", load_start=load_start, load_end=load_end, notes=notes,
                  max_new_tokens=max_new, repeats=repeats, ks=ks, weights=weights,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                  command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print(format_report(report))
    out = Path(args.json_out) if args.json_out else Path("bench") / "results" / f"bench-{report['mode']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    progress(f"[bench] wrote {out}")
    png = out.with_suffix(".png")
    if plot(report, png):
        progress(f"[bench] wrote {png}")
    # q4 with the exported attention (q4+graph) stays width-dependent (graphs/two_rows.py covers the fused
    # attention only): its mismatches are reported, not failed; every other variant must be exact
    return 1 if any(m["weights"] not in INEXACT_VARIANTS for m in report["mismatches_spec"]) else 0

