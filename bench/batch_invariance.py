"""Batch invariance of the batched graphs (graphs.batch_slots) on ONNX Runtime, measured, not timed-tested.

For the configured model (default: the embedded SmolLM2-135M, fused attention) in fp32 and q4 it
prints max |logit diff| of
  - slot 0 alone (the other slots idle) vs the other slots filled with other prompts, for the (B, 1)
    step and the (B, k+1) verify call: does a row depend on the other rows?
  - slot 0 of a batched call vs the B=1 graph at the same position (step_1 / verify_<k+1>)
  - row 0 of a (B, k+1) call vs the (B, 1) step: what a slot that only steps gets when it rides
    along in a verify call (padding after its one token)
and the time of each call (medians), side by side in one run.

    PYTHONPATH=$PWD .venv/bin/python bench/batch_invariance.py [--batch 4] [--weights fp32 q4] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from spec_edge.config import Config
from spec_edge.graphs import batch_export, export
from spec_edge.runtime.backends.onnxruntime import ort_graphs, OrtRunner
from spec_edge.runtime.backends.ort_batch import BatchRunner
from spec_edge.runtime.tokenizer import Tokenizer

PROMPTS = ["Rewrite this sentence so it is shorter: the robot arm moves to the left side of the table.",
           "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
           "List three safety checks before a mobile robot enters a corridor with people.",
           "Translate to French: the battery is low, return to the charging station now.",
           "Explain in one paragraph what a Kalman filter does for a drone.",
           "Summarise: the gripper failed twice, the second time after a firmware update.",
           "Write a haiku about a warehouse robot at night.",
           "What is 17 times 23? Show the steps."]


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(cfg: Config, k: int) -> dict:
    batch = cfg.graphs.batch_slots
    single_dir = ort_graphs(cfg, "target", export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), print),
                            print)
    runner, single = BatchRunner(batch_export.batch_graphs(cfg, print)), OrtRunner(single_dir)
    tok = Tokenizer(single_dir)
    prompts = [tok.encode(p) for p in PROMPTS[:batch]]
    rng = np.random.default_rng(0)
    out = {"step_width": runner.step_width}
    pos = [len(p) for p in prompts]

    def fill():
        for slot, prompt in enumerate(prompts):
            runner.prefill(slot, prompt, 0)

    for width in (1, 2, k + 1):
        tokens = rng.integers(100, 20000, (batch, width))
        if width == 2:
            tokens[:, 1] = tokens[:, 0]  # the two-row step: the pending token twice
        fill()
        full = runner.forward(tokens, pos, [True] * batch).copy()
        full_ms = timed(lambda: runner.forward(tokens, pos, [True] * batch))
        runner.prefill(0, prompts[0], 0)
        alone = runner.forward(tokens, pos, [True] + [False] * (batch - 1)).copy()
        single.prefill(prompts[0], 0)
        b1 = list(tokens[0]) if width != 2 else [int(tokens[0, 0])]  # B=1: width 2 is the step (two rows for q4)
        ref = single.forward(b1, pos[0]).copy()
        single_ms = timed(lambda: single.forward(b1, pos[0]))
        rows = len(b1)
        out[f"B{batch}x{width}"] = {"row0_alone_vs_filled": float(np.abs(alone[0] - full[0]).max()),
                                    "vs_B1_graph": float(np.abs(full[0, :rows] - ref).max()),
                                    "argmax_equal": bool((full[0, :rows].argmax(-1) == ref.argmax(-1)).all()),
                                    "batched_ms": round(full_ms, 2), "B1_ms": round(single_ms, 2)}
    # a stepping slot riding along in a verify call: its one token, then padding (the pending token again)
    tokens = np.repeat(rng.integers(100, 20000, (batch, 1)), k + 1, axis=1)
    fill()
    wide = runner.forward(tokens, pos, [True] * batch)[:, 0].copy()
    for width in (1, 2):
        fill()
        step = runner.forward(tokens[:, :width], pos, [True] * batch)[:, 0].copy()
        out[f"padded_row0_vs_step{width}"] = float(np.abs(wide - step).max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--weights", nargs="+", default=["fp32", "q4"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--config", default="")
    args = parser.parse_args()
    from spec_edge import config as config_mod

    base = config_mod.load(args.config) if args.config else Config()
    results = {}
    for weights in args.weights:
        cfg = base.replace(**{"graphs.batch_slots": args.batch, "graphs.weights": weights})
        results[weights] = measure(cfg, args.k)
        print(weights, json.dumps(results[weights], indent=1), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
