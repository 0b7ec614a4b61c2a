"""What a verify call costs against its width on a profile: step and verify[k+1] for every exported k, at the
given row counts, timed interleaved round by round in one process (k_choice.occupancy_costs: a load change hits
every width alike; the fastest of the rounds, as the engine's own k_choice.measure_costs), printed as ms and as
steps (verify / step at the same rows). A verify of width k+1 that gets a drafted tokens accepted yields a+1 tokens
for that many steps: it beats plain steps when a + 1 > its cost in steps, and a wider one pays only where its
extra accepted tokens outgrow its extra cost.

    PYTHONPATH=$PWD .venv/bin/python bench/verify_width.py [--config C] [--k-values 4 8 12 16]
        [--engine-dir DIR] [--rows 1 4] [--rounds 15] [--position 256]

The graphs must be exported (spec-edge export --weights q4 --k-values ... --engine-dir DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spec_edge import artifacts  # noqa: E402
from spec_edge.config import Config, load  # noqa: E402
from spec_edge.runtime import k_choice  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="profile YAML (default: the default profile)")
    parser.add_argument("--k-values", type=int, nargs="+", default=[4, 8, 12, 16])
    parser.add_argument("--engine-dir", help="runtime.engine_dir holding the graphs")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--position", type=int, default=256)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    cfg = load(args.config) if args.config else Config()
    changes = {"graphs.k_values": tuple(args.k_values), "speculative.drafter": "ngram"}
    if args.engine_dir:
        changes["runtime.engine_dir"] = args.engine_dir
    engine = artifacts.engine(cfg.replace(**changes), lambda m: print(m, file=sys.stderr))
    runner = engine.runner
    widths = sorted(runner.widths)
    load = [os.getloadavg()[0]]
    costs, _ = k_choice.occupancy_costs(k_choice.forward_call(runner, args.position), args.rows, widths, args.rounds,
                                        pick=min)  # as k_choice.measure_costs: a busy machine flattens the median
    load.append(os.getloadavg()[0])
    print(f"{cfg.graphs.weights}, position {args.position}, fastest of {args.rounds} interleaved rounds, "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")
    for rows in args.rows:
        step = costs[(rows, runner.step_width)]  # the step graph (q4: two rows per slot, runner.step_width 2)
        cells = [f"step {step:6.1f} ms"] + [
            f"verify[{w}] {costs[(rows, w)]:6.1f} ms = {costs[(rows, w)] / step:4.2f} steps"
            for w in widths if w != runner.step_width]
        print(f"rows {rows}: " + ", ".join(cells))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"costs_ms": {f"{j}x{w}": ms for (j, w), ms in costs.items()},
                                                   "load": load, "rounds": args.rounds,
                                                   "position": args.position}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
