"""The load policy in the batched loop, side by side in one process: plain, always speculative.k and a
serve.speculate_k_by_load table, for N requests joining at once (runtime/speculative.py, no ROS).

    PYTHONPATH=$PWD .venv/bin/python bench/batch_policy.py --config bench/results/tuned_k_by_load_b8.yaml \\
        [--clients 1 2 4 8] [--max-new-tokens 48] [--rounds 2] [--out bench/results/batch_policy.json]

--config: a profile with graphs.batch_slots > 1 (its table, speculative.k, graphs.k_values; `spec-edge
tune` writes one). Greedy n-gram requests (bench/prompts.jsonl, edit and free-form); per N and round the
three policies run in rotating order; prints total tok/s (all tokens / time until the last leaves),
medians over rounds of the rates and of the per-round ratios, the verify calls by k, and whether every
output equals the plain one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from spec_edge import config as cfgmod
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.onnxruntime import target_graphs
from spec_edge.runtime.backends.ort_batch import BatchRunner
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.tools.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    cfg = cfgmod.load(args.config)
    table, k = list(cfg.serve.speculate_k_by_load), cfg.speculative.k
    graph_dir = target_graphs(cfg, print)
    runner = BatchRunner(graph_dir, cfg.runtime.threads, slots=cfg.graphs.batch_slots)
    engine = Engine(cfg, runner, Tokenizer(graph_dir), graph_dir, progress=lambda m: None)
    prompts = [engine.prompt_ids(GenerateRequest(prompt=p["prompt"]))
               for p in load_prompts(kinds=["edit", "free-form"])]
    policies = {"plain": (0, []), f"k={k}": (k, []), "table": (k, table)}  # table: serve.speculate_k_by_load
    load_start = os.getloadavg()[0]
    rates = {str(n): {name: [] for name in policies} for n in args.clients}
    by_k, equal = {str(n): {} for n in args.clients}, True
    for r in range(args.rounds):
        for n in args.clients:
            names = list(policies)
            outputs = {}
            for name in names[r % 3:] + names[:r % 3]:
                loop_k, loop_table = policies[name]
                requests = [speculative.SlotRequest(prompt_ids=prompts[i % len(prompts)], max_new_tokens=args.max_new_tokens,
                                              eos_ids=engine.eos_ids, drafter=NgramDrafter() if loop_k else None)
                            for i in range(n)]
                t0 = time.perf_counter()
                out = speculative.generate_all(runner, requests, loop_k, k_by_load=loop_table)
                rates[str(n)][name].append(sum(len(ids) for ids, _, _ in out) / (time.perf_counter() - t0))
                outputs[name] = [ids for ids, _, _ in out]
                counts = [stats.verify_calls_by_k for _, _, stats in out] if loop_k else []
                by_k[str(n)][name] = [sum(col) for col in zip(*counts)]
                print(f"round {r} N={n} {name}: {rates[str(n)][name][-1]:.1f} tok/s", flush=True)
            equal &= all(o == outputs["plain"] for o in outputs.values())
    data = {"config": args.config, "table": table, "k": k, "rates": rates, "verify_calls_by_k": by_k,
            "outputs_equal": equal, "load_start": load_start, "load_end": os.getloadavg()[0],
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds}
    print(report(data))
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))


def report(data: dict) -> str:
    """Medians over rounds of the total tok/s and of the per-round ratios (the runs of one round are
    seconds apart: on a shared machine their ratio is the result, not the rates)."""
    lines = [f"total tok/s, median of {data['rounds']} rounds; table = {data['table']}; load {data['load_start']:.2f}"
             f" -> {data['load_end']:.2f}; per-round ratios: table / plain, table / k={data['k']}, table / the "
             f"better of the two",
             f"{'N':>3s}{'plain':>8s}{'k=' + str(data['k']):>8s}{'table':>8s}{'/plain':>8s}{'/k':>8s}{'/best':>8s}"
             f"   table's verify calls by k (last round)"]
    for n, r in data["rates"].items():
        med = {name: statistics.median(v) for name, v in r.items()}
        kk = f"k={data['k']}"
        ratios = [statistics.median(t / o for t, o in zip(r["table"], other)) for other in
                  (r["plain"], r[kk], [max(p, q) for p, q in zip(r["plain"], r[kk])])]
        lines.append(f"{n:>3}{med['plain']:8.1f}{med[kk]:8.1f}{med['table']:8.1f}"
                     + "".join(f"{x:8.2f}" for x in ratios) + f"   {data['verify_calls_by_k'][n]['table']}")
    lines.append(f"every output equals plain: {data['outputs_equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
