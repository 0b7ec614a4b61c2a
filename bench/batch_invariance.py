"""Batch invariance of the batched graphs (graphs.batch_slots) on ONNX Runtime, measured, not timed-tested.

For the configured model (default: the embedded SmolLM2-135M, fused attention) in fp32 and q4 it
prints, for calls over n = 1 .. B of the slots (every row count the runner has: n = 1 the B=1 graphs,
n >= 2 the graph of the smallest exported row count >= n; "padded": n >= 2 rows through the B-row graph,
its B - n padding rows bound to the scratch region) at the step width (q4: the two-row step) and at
k+1, max |logit diff| of each row against the B=1 graph
(step_1 / verify_<k+1>) at the same position over the same slot's cache, and whether the argmax ids
agree; then row 0 of a (k+1) call that a stepping slot rides along in ([pending] * (k+1)) against
its step row.

    PYTHONPATH=$PWD .venv/bin/python bench/batch_invariance.py [--batch 4] [--weights fp32 q4] [--k 4]
"""
from __future__ import annotations

import argparse
import json

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


def measure(cfg: Config, k: int) -> dict:
    batch = cfg.graphs.batch_slots
    single_dir = ort_graphs(cfg, "target", export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), print),
                            print)
    runner, single = BatchRunner(batch_export.batch_graphs(cfg, print)), OrtRunner(single_dir)
    tok = Tokenizer(single_dir)
    prompts = [tok.encode(PROMPTS[slot % len(PROMPTS)] + " " * (slot // len(PROMPTS))) for slot in range(batch)]
    rng = np.random.default_rng(0)
    step = runner.step_width
    out = {"step_width": step, "row_counts": list(runner.row_counts)}

    def fill():
        for slot, prompt in enumerate(prompts):
            runner.prefill(slot, prompt, 0)

    exported = runner.row_counts
    for n, counts in [(n, exported) for n in range(1, batch + 1)] + [(n, (batch,)) for n in range(2, batch)]:
        runner.row_counts = counts
        slots = list(range(batch - n, batch))  # the last n slots: row j is not slot j
        pos = [len(prompts[slot]) for slot in slots]
        for width in (step, k + 1):
            tokens = rng.integers(100, min(20000, runner.vocab_size), (n, width))
            if width == step:
                tokens[:, 1:] = tokens[:, :1]  # the (two-row) step: the pending token repeated
            fill()
            rows = runner.forward(slots, tokens, pos).copy()
            diff, same = 0.0, True
            for j, slot in enumerate(slots):
                single.prefill(prompts[slot], 0)
                b1 = list(tokens[j]) if width != step else [int(tokens[j, 0])]  # B=1: the step takes one token
                ref = single.forward(b1, pos[j])
                diff = max(diff, float(np.abs(rows[j, :len(b1)] - ref).max()))
                same &= bool((rows[j, :len(b1)].argmax(-1) == ref.argmax(-1)).all())
            out[f"n{n}x{width}" + ("_padded" if counts != exported else "")] = {
                "rows": runner.rows_for(n), "vs_B1_graph": diff, "argmax_equal": same}
    runner.row_counts = exported
    # a stepping slot riding along in a verify call: its one token, then padding (the pending token again)
    slots = list(range(batch))
    tokens = np.repeat(rng.integers(100, min(20000, runner.vocab_size), (batch, 1)), k + 1, axis=1)
    pos = [len(p) for p in prompts]
    fill()
    wide = runner.forward(slots, tokens, pos)[:, 0].copy()
    fill()
    narrow = runner.forward(slots, tokens[:, :step], pos)[:, 0].copy()
    out[f"padded_row0_vs_step{step}"] = float(np.abs(wide - narrow).max())
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
