"""A/B of the q4 pass's sibling stacking: the same fused fp32 graphs carried into MatMulNBits with
q/k/v and gate/up stacked (one kernel each; q/k/v packed straight into GroupQueryAttention, gate/up
split; the default) and with one MatMulNBits per linear layer, timed interleaved in one process
(step[1] and every verify width at one position).

    .venv/bin/python bench/q4_stack_ab.py [--profile smollm2-135m] [--rounds 30] [--position 300]

The two variants are written to a temporary folder; the profile's own q4 folder is not touched.
"""
from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import numpy as np

from spec_edge.config import Config
from spec_edge.graphs import export, ort_attention, quantize
from spec_edge.graphs.weights import embedded_gguf_path
from spec_edge.runtime.backends.onnxruntime import OrtRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--position", type=int, default=300)
    args = parser.parse_args()
    cfg = Config().replace(**{"runtime.profile": args.profile})
    source = ort_attention.ensure_fused(export.export_model(cfg, "target", export.artifact_dir(cfg, "target")))
    rewrite = quantize.rewrite_model
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stacked in (True, False):
            out = Path(tmp) / f"stacked_{stacked}"
            quantize.rewrite_model = functools.partial(rewrite, merge=stacked)
            try:
                quantize._convert(source, out, embedded_gguf_path(), "ab", 4, print)
            finally:
                quantize.rewrite_model = rewrite
            runners[stacked] = OrtRunner(out)
        widths = sorted(runners[True].widths)
        for runner in runners.values():
            runner.prefill(list(range(100, 100 + args.position)), 0)
        times = {(stacked, w): [] for stacked in runners for w in widths}
        for rnd in range(args.rounds):
            order = [True, False] if rnd % 2 else [False, True]
            for stacked in order:
                for w in widths:
                    t0 = time.perf_counter()
                    runners[stacked].forward(list(range(7, 7 + w)), args.position)
                    times[(stacked, w)].append(time.perf_counter() - t0)
        for w in widths:
            a, b = (np.median(times[(s, w)]) * 1e3 for s in (True, False))
            print(f"width {w}: stacked {a:.2f} ms, separate {b:.2f} ms, stacked/separate {a / b:.3f}")
        logits = [runners[s].forward([5], args.position).copy() for s in (True, False)]
        print(f"logits max |stacked - separate| {float(np.abs(logits[0] - logits[1]).max()):.3g}")


if __name__ == "__main__":
    main()
