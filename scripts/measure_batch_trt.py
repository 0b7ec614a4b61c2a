"""Timings of the batched TensorRT engine (graphs.batch_slots = B) on a device, beside the B=1 engine of the
same model and shapes: a (n, 1) step and an (n, k+1) verify for n = 1..B occupied slots (CUDA graphs, and
eager), one slot called at the highest slot (B - 1 idle rows), a prefill chunk. scripts/device_check_batch.sh
runs it after the device tests; the engines are built here unless up to date (SPEC_EDGE_BATCH_ENGINE_DIR).

    PYTHONPATH=$PWD python scripts/measure_batch_trt.py [--slots 4] [--max-context 256] [--json OUT.json]
    PYTHONPATH=$PWD python scripts/measure_batch_trt.py --cpu   # the same calls through ONNX Runtime (a dry run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from spec_edge.config import from_params
from spec_edge.device import builder
from spec_edge.graphs import batch_dynamic

PROMPT = [1, 28, 1350, 314, 253, 1345, 30, 198, 504, 3158, 282, 4290, 314, 1345, 30, 2] * 3  # test_tensorrt.PROMPT


def config(engine_dir: str, slots: int, max_context: int, dtype: str, k: int):
    return from_params({"model.target": "embedded", "runtime.backend": "tensorrt", "runtime.engine_dir": engine_dir,
                        "runtime.profile": f"smollm2_trt_b{slots}_{dtype}" + ("" if max_context == 256 else
                                                                             f"_s{max_context}"),
                        "graphs.max_context": max_context, "graphs.prefill_chunk": 32, "graphs.k_values": [k],
                        "graphs.dtype": dtype, "graphs.batch_slots": slots, "speculative.drafter": "ngram",
                        "speculative.k": k})


def median_ms(call, repeats: int) -> float:
    for _ in range(3):  # the first call at a new shape is eager and captures the CUDA graph
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()  # argmax: returns after the ids reached the host (a stream sync)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def batched_rows(runner, slots: int, k: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    for slot in range(slots):
        runner.prefill(slot, PROMPT, 0)
    rows = []
    for n in range(1, slots + 1):  # ascending: a width's rows grow at once (batch_rows.RowCount)
        called = list(range(n))
        row = {"rows": n, "called": n}
        for name, width in (("step_ms", 1), ("verify_ms", k + 1)):
            tokens = rng.integers(0, runner.vocab_size, (n, width))
            row[name] = median_ms(lambda: runner.argmax(called, tokens, [len(PROMPT)] * n), repeats)
        rows.append(row)
    last = [slots - 1]
    step = rng.integers(0, runner.vocab_size, (1, 1))
    rows.append({"rows": slots, "called": 1, "step_ms": median_ms(lambda: runner.argmax(last, step, [len(PROMPT)]),
                                                                    repeats)})
    chunk = PROMPT[:runner.prefill_chunk]
    rows.append({"prefill_chunk_ms": median_ms(lambda: runner.prefill_chunk_at(0, chunk, 0), repeats)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--engine-dir", default=os.environ.get("SPEC_EDGE_BATCH_ENGINE_DIR", "/tmp/spec_edge_batch"))
    parser.add_argument("--cpu", action="store_true", help="ONNX Runtime over the float32 file: checks this script")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    quiet = lambda _m: None  # noqa: E731
    results: dict = {"slots": args.slots, "max_context": args.max_context, "k": args.k}
    if args.cpu:
        from spec_edge.runtime.backends.ort_batch_dynamic import OrtBatchDynamicRunner

        cfg = config(args.engine_dir + "/cpu", args.slots, args.max_context, "float32", args.k)
        builder.export_only(cfg, progress=quiet)
        runner = OrtBatchDynamicRunner(batch_dynamic.folder(cfg), [1, args.k + 1])
        results["device"] = "cpu (onnxruntime, float32)"
        results["graphed"] = batched_rows(runner, args.slots, args.k, args.repeats)
    else:
        import tensorrt
        import torch

        from spec_edge.runtime.backends.tensorrt import TensorRTRunner
        from spec_edge.runtime.backends.trt_batch import TensorRTBatchRunner

        cfg = config(args.engine_dir, args.slots, args.max_context, "float16", args.k)
        started = time.monotonic()
        builder.build(cfg, progress=quiet)
        results.update(device=torch.cuda.get_device_name(), tensorrt=tensorrt.__version__,
                       build_s=round(time.monotonic() - started, 1))
        results["graphed"] = batched_rows(TensorRTBatchRunner(cfg), args.slots, args.k, args.repeats)
        results["eager"] = batched_rows(TensorRTBatchRunner(cfg, cuda_graphs=False), args.slots, args.k, args.repeats)
        single = config(args.engine_dir, 1, args.max_context, "float16", args.k)
        builder.build(single, progress=quiet)
        b1 = TensorRTRunner(single)
        b1.prefill(PROMPT, 0)
        results["b1"] = {name: median_ms(lambda w=w: b1.argmax(PROMPT[:w], len(PROMPT)), args.repeats)
                         for name, w in (("step_ms", 1), ("verify_ms", args.k + 1))}
    print(json.dumps({key: value for key, value in results.items() if not isinstance(value, list)}))
    for mode in ("graphed", "eager"):
        for row in results.get(mode, []):
            print(mode, " ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                                 for key, value in row.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
