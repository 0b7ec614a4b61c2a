"""A/B of two q4 graph folders of the embedded default in one process, interleaved: the old step
graphs (Q4_FORMAT 3, a one-row step) against the width-2 step graphs (Q4_FORMAT 4,
spec_edge/graphs/two_rows.py). Per folder: the CPU time of step[1] and verify[5] (one thread,
time.process_time: on a shared machine the wall clock is mostly other people's load), then
target-only and ngram k=4 on every bench prompt, rotated round by round, with the exactness of each
speculative run against the same folder's target-only run.

    .venv/bin/python bench/q4_two_rows_ab.py --before DIR --after DIR [--repeats 3] [--threads 1]

DIR: a target_fused_q4 folder (the before one made with the previous commit's quantize.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from spec_edge.config import Config
from spec_edge.runtime.backends.onnxruntime import OrtRunner
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.tools.prompts import load_prompts


def cpu_costs(runners: dict, rounds: int, position: int) -> None:
    calls = {}
    for name, runner in runners.items():
        runner.prefill(list(range(10, 10 + position)), 0)
        calls[(name, 1)] = lambda r=runner: r.forward([11], position)
        calls[(name, 5)] = lambda r=runner: r.forward(list(range(10, 15)), position)
    for call in calls.values():  # warm-up
        call()
    cpu = {key: [] for key in calls}
    keys = list(calls)
    for i in range(rounds):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            started = time.process_time()
            calls[key]()
            cpu[key].append((time.process_time() - started) * 1e3)
    med = {key: statistics.median(values) for key, values in cpu.items()}
    for name in runners:
        print(f"{name}: CPU ms step[1] {med[(name, 1)]:.2f}, verify[5] {med[(name, 5)]:.2f} "
              f"= {med[(name, 5)] / med[(name, 1)]:.2f} steps")
    print(f"after/before CPU: step {med[('after', 1)] / med[('before', 1)]:.3f}, "
          f"verify[5] {med[('after', 5)] / med[('before', 5)]:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--after", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--position", type=int, default=300)
    args = parser.parse_args()
    cfg = Config().replace(**{"runtime.threads": args.threads, "graphs.k_values": [4]})
    dirs = {"before": args.before, "after": args.after}
    cpu_costs({name: OrtRunner(d, args.threads) for name, d in dirs.items()}, args.rounds, args.position)
    engines = {name: Engine(cfg, OrtRunner(d, args.threads), Tokenizer(d), d, progress=lambda m: None)
               for name, d in dirs.items()}
    prompts = load_prompts()
    systems = [(name, drafter) for name in engines for drafter in ("none", "ngram")]
    speed = {s: [] for s in systems}
    out = {}
    for engine in engines.values():
        engine.generate(GenerateRequest(prompt=prompts[0]["prompt"], max_new_tokens=8))
    i = 0
    for rep in range(args.repeats):
        for p in prompts:
            for name, drafter in systems[i % len(systems):] + systems[:i % len(systems)]:
                spec = drafter != "none"
                result = engines[name].generate(GenerateRequest(
                    prompt=p["prompt"], drafter=drafter if spec else None, speculate=spec, k=4 if spec else None,
                    max_new_tokens=96, temperature=0.0, seed=1234 + rep))
                speed[(name, drafter)].append(result.stats.tokens_per_s)
                out[(name, drafter, p["id"], rep)] = list(result.token_ids)
            i += 1
    n = len(prompts) * args.repeats
    for name in engines:
        exact = sum(out[(name, "ngram", p["id"], r)] == out[(name, "none", p["id"], r)]
                    for p in prompts for r in range(args.repeats))
        print(f"{name}: target-only {statistics.median(speed[(name, 'none')]):.1f} tok/s, ngram k=4 "
              f"{statistics.median(speed[(name, 'ngram')]):.1f} tok/s, ngram == target-only {exact}/{n}")
    for drafter in ("none", "ngram"):
        ratios = [a / b for a, b in zip(speed[("after", drafter)], speed[("before", drafter)])]
        print(f"after/before {drafter}: median of per-round ratios {statistics.median(ratios):.3f}")
    same = sum(out[("after", "none", p["id"], r)] == out[("before", "none", p["id"], r)]
               for p in prompts for r in range(args.repeats))
    print(f"target-only greedy text, after == before: {same}/{n}")


if __name__ == "__main__":
    main()
