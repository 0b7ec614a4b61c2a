"""Calls over a subset of the slots, measured (not a timed test): the cost of a call over n of the B
slots, n = 1 .. B, at the step width and at k+1, for

  - old: the runner that ran all B rows in every call (inactive rows fed dummy tokens), its source
    taken from git (--old-rev) over its own export (--old-graphs, made by that revision);
  - new, m = n: today's runner with a graph of exactly n rows (every row count exported);
  - new, m = pow2: the graph of the smallest power of two >= n (batch_export.row_counts' choice);

side by side in one process, calls interleaved by round (medians, ms); and the cost of making one IO
binding (a call over a subset not seen before) against a call that finds its binding kept.

    git worktree add /tmp/old 819a949 && (cd /tmp/old && PYTHONPATH=$PWD python -c "from spec_edge.config
        import Config; from spec_edge.graphs import batch_export as b
        b.batch_graphs(Config().replace(**{'graphs.batch_slots': 8}))")
    PYTHONPATH=$PWD .venv/bin/python bench/batch_rows.py --old-rev 819a949 \\
        --old-graphs /tmp/old/engines/smollm2-135m/onnx/target_b8_fused [--weights fp32] [--rounds 7]

(q4: --weights q4 --old-graphs <the old folder>_q4, made by quantize.ensure_q4 from the fp32 one). The
new graphs of every row count go to their own profile (<profile>-rows), not the default folders.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from spec_edge.config import Config
from spec_edge.graphs import batch_export
from spec_edge.runtime.backends.ort_batch import BatchRunner

from _old_rev import ab_parser, old_module



def pow2(n: int, batch: int) -> int:
    return 1 if n == 1 else min(batch, 1 << (n - 1).bit_length())


def main() -> None:
    parser = ab_parser(__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    batch, k = args.slots, args.k
    cfg = Config().replace(**{"graphs.batch_slots": batch, "graphs.weights": args.weights,
                              "runtime.profile": f"{Config().runtime.profile}-rows"})
    new = BatchRunner(batch_export.batch_graphs(cfg, print, rows=tuple(range(2, batch + 1))))
    old = old_module(args.old_rev, "spec_edge/runtime/backends/ort_batch.py").BatchRunner(args.old_graphs)
    assert old.step_width == new.step_width and old.batch == batch
    prompt = list(range(100, 100 + args.position))
    for runner in (old, new):
        for slot in range(batch):
            runner.prefill(slot, prompt, 0)
    rows = tuple(new.row_counts)

    def new_call(m: int, n: int, width: int):
        tokens, positions = np.full((n, width), 11, np.int64), [args.position] * n

        def call():
            new.row_counts = (m,)  # force the graph of m rows
            new.forward(list(range(n)), tokens, positions)
        return call

    def old_call(n: int, width: int):
        tokens, positions = np.full((batch, width), 11, np.int64), [args.position] * batch
        active = [slot < n for slot in range(batch)]
        return lambda: old.forward(tokens, positions, active)

    calls = {}
    for n in range(1, batch + 1):
        for width in (new.step_width, k + 1):
            calls[("old", n, width)] = old_call(n, width)
            for m in sorted({1 if n == 1 else n, pow2(n, batch)}):
                calls[(f"m{m}", n, width)] = new_call(m, n, width)
    times: dict = {key: [] for key in calls}
    for call in calls.values():
        call()
    keys = list(calls)
    for r in range(args.rounds):
        for key in keys[r * 7 % len(keys):] + keys[:r * 7 % len(keys)]:
            t0 = time.perf_counter()
            calls[key]()
            times[key].append((time.perf_counter() - t0) * 1e3)
    new.row_counts = rows
    med = {key: statistics.median(value) for key, value in times.items()}
    # a new binding (a subset not seen before): B rows of L layers, 4 views each
    graph, regions = new._batched[(k + 1, batch)], tuple(range(batch))
    bind_ms = []
    for i in range(5):
        t0 = time.perf_counter()
        new._binding(("bench", i), graph, regions, per_row=True)
        bind_ms.append((time.perf_counter() - t0) * 1e3)
    print(f"\n{args.weights}, B={batch}, position {args.position}, {args.rounds} rounds, load "
          f"{os.getloadavg()[0]:.2f}; ms per call (medians)")
    print("| n | width | old (all B rows) | new, m = n | new, m = pow2 | m = n / old | m = pow2 / old |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    table = []
    for n in range(1, batch + 1):
        for width in (new.step_width, k + 1):
            o, exact, padded = (med[("old", n, width)], med[(f"m{1 if n == 1 else n}", n, width)],
                                med[(f"m{pow2(n, batch)}", n, width)])
            table.append({"n": n, "width": width, "old_ms": o, "exact_ms": exact, "pow2_ms": padded})
            print(f"| {n} | {width} | {o:.1f} | {exact:.1f} | {padded:.1f} | {exact / o:.2f} | {padded / o:.2f} |")
    print(f"new IO binding (width {k + 1}, {batch} rows, {2 * new.model_cfg.n_layers * batch} cache views): "
          f"{statistics.median(bind_ms):.2f} ms median; load {os.getloadavg()[0]:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"weights": args.weights, "batch": batch, "k": k, "table": table,
                                              "bind_ms": statistics.median(bind_ms),
                                              "loadavg": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
