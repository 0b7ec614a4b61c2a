"""Speculative greedy == target-only greedy on each Q/DQ form of the target, for the drafters of a
profile (e.g. config/smollm2_eagle3.yaml: eagle3 with heads/smollm2-135m-eagle3, and ngram).

    PYTHONPATH=. python bench/qdq_exactness.py --config config/smollm2_eagle3.yaml --weights int4_gguf nvfp4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_edge.config import load  # noqa: E402
from spec_edge.runtime import speculative  # noqa: E402
from spec_edge.runtime.engine import Engine  # noqa: E402
from spec_edge.tools.prompts import load_prompts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--weights", nargs="+", required=True)
    parser.add_argument("--drafters", nargs="+", default=["eagle3", "ngram"])
    parser.add_argument("--kinds", nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    base = load(args.config)
    prompts = [p["prompt"] for p in load_prompts(None, args.kinds)]
    for form in args.weights:
        engine = Engine.from_config(base.replace(**{"graphs.weights": form}), lambda m: None)
        counts = {}
        for prompt in prompts:
            ids = engine.tokenizer.encode(engine.tokenizer.render_chat([("user", prompt)]))
            plain = speculative.generate(engine.target, ids, max_new_tokens=args.max_new_tokens,
                                         eos_ids=engine.eos_ids)[0]
            for name in args.drafters:
                got, _, stats = speculative.generate(engine.target, ids, max_new_tokens=args.max_new_tokens,
                                                     eos_ids=engine.eos_ids, drafter=engine.drafter(name),
                                                     k=base.speculative.k)
                same, calls = counts.get(name, (0, 0))
                counts[name] = (same + (got == plain), calls + stats.verify_calls)
        summary = {name: f"{same}/{len(prompts)} exact, {calls} verify calls" for name, (same, calls) in counts.items()}
        print(form, summary, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
