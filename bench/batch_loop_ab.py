"""The in-flight batching loop before and after calls over a subset of the slots, end to end in one
process (not a timed test): N greedy requests (bench/prompts.jsonl) through one BatchLoop of B slots,
the loop and runner of git revision --old-rev (over its own export, --old-graphs) against today's,
alternating by round; prints total tok/s of each, the ratio, and whether the outputs are equal.

    PYTHONPATH=$PWD .venv/bin/python bench/batch_loop_ab.py --old-rev 819a949 \\
        --old-graphs <that revision's target_b8_fused> [--weights fp32] [--clients 2 4 8] [--drafter ngram]

(the old export as in bench/batch_rows.py).
"""
from __future__ import annotations

import os
import statistics
import time

from spec_edge.config import Config
from spec_edge.graphs import batch_export
from spec_edge.runtime import batch
from spec_edge.runtime.backends.ort_batch import BatchRunner
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.tools.prompts import load_prompts

from _old_rev import ab_parser, old_module


def main() -> None:
    parser = ab_parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--drafter", default="ngram", choices=["ngram", "none"])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cfg = Config().replace(**{"graphs.batch_slots": args.slots, "graphs.weights": args.weights})
    graph_dir = batch_export.batch_graphs(cfg, print)
    variants = {"old": (old_module(args.old_rev, "spec_edge/runtime/batch.py").generate_all,
                        old_module(args.old_rev, "spec_edge/runtime/backends/ort_batch.py").BatchRunner(args.old_graphs)),
                "new": (batch.generate_all, BatchRunner(graph_dir))}
    engine = Engine(cfg, variants["new"][1], Tokenizer(graph_dir), graph_dir, progress=lambda m: None)
    prompts = [engine.prompt_ids(GenerateRequest(prompt=p["prompt"])) for p in load_prompts()]
    k = cfg.speculative.k if args.drafter == "ngram" else 0
    print(f"{args.weights}, B={args.slots}, drafter {args.drafter}, {args.max_new_tokens} new tokens, "
          f"load {os.getloadavg()[0]:.2f}")
    for clients in args.clients:
        rates, outputs = {name: [] for name in variants}, {}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                generate_all, runner = variants[name]
                requests = [batch.SlotRequest(prompt_ids=prompts[i % len(prompts)], max_new_tokens=args.max_new_tokens,
                                              eos_ids=engine.eos_ids,
                                              drafter=NgramDrafter() if args.drafter == "ngram" else None)
                            for i in range(clients)]
                t0 = time.perf_counter()
                out = generate_all(runner, requests, k)
                rates[name].append(sum(len(ids) for ids, _, _ in out) / (time.perf_counter() - t0))
                outputs[name] = [ids for ids, _, _ in out]
        old, new = statistics.median(rates["old"]), statistics.median(rates["new"])
        print(f"{clients} clients: old {old:.1f} tok/s, new {new:.1f} tok/s, new / old = {new / old:.2f}; "
              f"outputs equal: {outputs['old'] == outputs['new']}; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
