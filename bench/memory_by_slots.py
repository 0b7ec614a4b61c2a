"""A node's memory by slot count and weights form: RSS / Pss after loading and after requests, and tok/s,
for graphs.batch_slots x graphs.weights, each configuration in its own process, one table.

    PYTHONPATH=$PWD .venv/bin/python bench/memory_by_slots.py [--slots 1 4 8] [--weights fp32 q4]
        [--code /path/to/another/checkout ...] [--engine-dir DIR] [--config PROFILE.yaml]

--code: the checkouts whose spec_edge runs the configurations (default: this one), side by side per
configuration (e.g. the previous main against this branch). Each configuration is loaded once by
each checkout before it is measured, so an export or a post-export pass of a first start is not in
its numbers. Columns: VmRSS and Pss (MB; Pss counts a page mapped by several sessions once, VmRSS
once per mapping) after loading and after the requests; anon: the process's anonymous memory after
the requests; weights: the graph folder's weights.bin; KV: the target's resident cache; tok/s: greedy
answers to --requests prompts of --max-new-tokens, timed after one warm-up answer (noisy on a shared
machine: compare rows of one run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def memory() -> dict:
    """VmRSS, RssAnon (/proc/self/status) and Pss (/proc/self/smaps_rollup) of this process, in MB."""
    out = {}
    for name, keys in (("status", ("VmRSS", "RssAnon")), ("smaps_rollup", ("Pss",))):
        for line in Path(f"/proc/self/{name}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) / 1024
    return out


def child(spec: dict) -> None:
    """Load one configuration, answer the requests, print one JSON line."""
    import time

    from spec_edge import config as cfgmod
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one
    from spec_edge.tools.prompts import load_prompts

    cfg = cfgmod.load(spec["config"]) if spec["config"] else cfgmod.Config()
    overrides = {"graphs.batch_slots": spec["slots"], "graphs.weights": spec["weights"]}
    if spec["engine_dir"]:
        overrides["runtime.engine_dir"] = spec["engine_dir"]
    cfg = cfg.replace(**overrides)
    quiet = print if spec["prepare"] else (lambda message: None)
    started = time.monotonic()
    from spec_edge import artifacts
    engine = artifacts.engine(cfg, quiet)
    load_s = time.monotonic() - started
    if spec["prepare"]:
        return
    loaded = memory()
    prompts = [p["prompt"] for p in load_prompts(kinds=["edit", "free-form"])]
    run_one(engine, GenerateRequest(prompt=prompts[-1], max_new_tokens=spec["max_new_tokens"]))  # warm-up
    tokens = seconds = 0.0
    for prompt in prompts[:spec["requests"]]:
        result = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=spec["max_new_tokens"]))
        tokens += len(result.token_ids)
        seconds += result.stats.total_time_s
    after = memory()
    runner = engine.runner  # the slotted runner: its whole cache (every slot)
    print(json.dumps({"load_s": load_s, "loaded": loaded, "after": after, "tok_s": tokens / seconds,
                      "weights_mb": (Path(engine.graph_dir) / "weights.bin").stat().st_size / 1e6,
                      "kv_mb": (runner.k_cache.nbytes + runner.v_cache.nbytes) / 1e6}))


def run(code: Path, spec: dict) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(code))
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=code,
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  {code} {spec['slots']} {spec['weights']}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1]) if not spec["prepare"] else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--weights", nargs="+", default=["fp32", "q4"])
    parser.add_argument("--code", type=Path, nargs="+", default=[HERE], help="checkouts to compare")
    parser.add_argument("--engine-dir", help="runtime.engine_dir (default: the profile's)")
    parser.add_argument("--config", help="base profile YAML (default: the built-in defaults)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    engine_dir = str(Path(args.engine_dir).absolute()) if args.engine_dir else ""
    config = str(Path(args.config).absolute()) if args.config else ""
    header = (f"{'code':<24} {'B':>2} {'weights':<7} {'RSS load':>9} {'Pss load':>9} {'RSS req':>8} {'Pss req':>8} "
              f"{'anon':>6} {'tok/s':>6} {'weights.bin':>11} {'KV':>6}")
    print(header, flush=True)
    for slots in args.slots:
        for weights in args.weights:
            spec = {"slots": slots, "weights": weights, "engine_dir": engine_dir, "config": config,
                    "requests": args.requests, "max_new_tokens": args.max_new_tokens, "prepare": True}
            for code in args.code:
                run(code, spec)  # exports / post-export passes of a first start, not measured
            for code in args.code:
                got = run(code, dict(spec, prepare=False))
                if got is None:
                    continue
                load, after = got["loaded"], got["after"]
                print(f"{str(code)[-24:]:<24} {slots:>2} {weights:<7} {load['VmRSS']:>9.0f} {load['Pss']:>9.0f} "
                      f"{after['VmRSS']:>8.0f} {after['Pss']:>8.0f} {after['RssAnon']:>6.0f} {got['tok_s']:>6.1f} "
                      f"{got['weights_mb']:>11.0f} {got['kv_mb']:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
