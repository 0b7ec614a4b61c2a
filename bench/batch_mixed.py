"""Slots that step beside slots that verify: one padded (n, k+1) call over all of them (mixed="pad") or
a step call over the stepping slots plus a (k+1) call over the verifying ones (mixed="group", the
default), measured side by side in one run (runtime/batch.py).

    PYTHONPATH=$PWD .venv/bin/python bench/batch_mixed.py [--slots 8] [--clients 8] [--max-new-tokens 48] [--rounds 2]

Runs --clients greedy n-gram requests (bench/prompts.jsonl) through one BatchLoop, both modes
alternating by round; prints total tok/s per mode, the ratio, and whether both
modes' tokens equal (pad's stepping rows are width-(k+1) rows: 3e-5 from a step's logits in fp32).
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cfg = Config().replace(**{"graphs.batch_slots": args.slots})
    graph_dir = batch_export.batch_graphs(cfg, print)
    runner = BatchRunner(graph_dir)
    engine = Engine(cfg, runner, Tokenizer(graph_dir), graph_dir, progress=lambda m: None)
    prompts = [engine.prompt_ids(GenerateRequest(prompt=p["prompt"]))
               for p in load_prompts(kinds=["edit", "free-form"])][:args.clients]
    rates, outputs = {m: [] for m in batch.MIXED}, {}
    for r in range(args.rounds):
        for mixed in (batch.MIXED if r % 2 == 0 else batch.MIXED[::-1]):
            requests = [batch.SlotRequest(prompt_ids=p, max_new_tokens=args.max_new_tokens, eos_ids=engine.eos_ids,
                                          drafter=NgramDrafter()) for p in prompts]
            t0 = time.perf_counter()
            out = batch.generate_all(runner, requests, cfg.speculative.k, mixed=mixed)
            seconds = time.perf_counter() - t0
            rates[mixed].append(sum(len(ids) for ids, _, _ in out) / seconds)
            outputs[mixed] = [ids for ids, _, _ in out]
            print(f"round {r} {mixed}: {rates[mixed][-1]:.1f} tok/s", flush=True)
    pad, group = statistics.median(rates["pad"]), statistics.median(rates["group"])
    print(f"pad {pad:.1f} tok/s, group {group:.1f} tok/s, pad / group = {pad / group:.3f}; "
          f"outputs equal: {outputs['pad'] == outputs['group']}")


if __name__ == "__main__":
    main()
