"""One client: the batched engine (graphs.batch_slots, one slot occupied: the B=1 graphs bound to it)
against today's engine, the same requests alternating in one process. Prints tok/s of each and the ratio.

    PYTHONPATH=$PWD .venv/bin/python bench/batch_single.py [--slots 8] [--rounds 3] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import statistics

from spec_edge.config import Config
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.tools.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    cfg = Config()
    engines = {"serial": Engine.from_config(cfg, print),
               "batched": Engine.from_config(cfg.replace(**{"graphs.batch_slots": args.slots}), print)}
    prompts = [p["prompt"] for p in load_prompts(kinds=["edit", "free-form"])][:args.prompts]
    for drafter in ("none", "ngram"):
        rates = {name: [] for name in engines}
        texts_of = {}
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                tokens = seconds = 0.0
                texts = []
                for prompt in prompts:
                    result = engines[name].generate(GenerateRequest(prompt=prompt, drafter=drafter,
                                                                    max_new_tokens=args.max_new_tokens))
                    tokens += len(result.token_ids)
                    seconds += result.stats.total_time_s
                    texts.append(result.text)
                rates[name].append(tokens / seconds)
                texts_of.setdefault(name, []).append(texts)
        serial, batched = statistics.median(rates["serial"]), statistics.median(rates["batched"])
        same = all(t == texts_of["serial"][0] for runs in texts_of.values() for t in runs)
        print(f"drafter {drafter}: serial {serial:.1f} tok/s, batched (1 of {args.slots} slots) {batched:.1f} tok/s, "
              f"batched / serial = {batched / serial:.3f}; texts equal: {same}", flush=True)


if __name__ == "__main__":
    main()
