"""Replay the n-gram drafter's gating on recorded greedy outputs: calls and speed-up without timing noise.

Greedy speculative decoding emits exactly the target-only greedy tokens, so which verify calls and
plain steps a drafter causes is a function of those tokens alone. This script decodes every prompt
once (target-only, greedy; cached in --cache), replays the speculative loop's control flow with each
drafter variant, and prices the calls with the measured cost ratio r = c_verify[k+1] / c_step:

    speed-up = (tokens - 1) / (plain steps + r * verify calls)

    .venv/bin/python bench/ngram_sim.py [--k 4] [--ratio 1.45] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def replay(drafter, prompt_ids: list[int], out: list[int], k: int) -> tuple[int, int, int]:
    """(tokens, plain steps, verify calls) the loop would make; out[0] comes from the prefill."""
    seq = list(prompt_ids) + [out[0]]
    drafter.start(list(prompt_ids))
    i, steps, verifies, accepted = 1, 0, 0, 0
    while i < len(out):
        draft = drafter.propose(seq, k)
        if draft is None:
            seq.append(out[i])
            i += 1
            steps += 1
            continue
        n = 0
        while n < k and i + n < len(out) and draft.tokens[n] == out[i + n]:
            n += 1
        drafter.observe(k, n)
        chunk = out[i:i + n + 1]
        seq.extend(chunk)
        i += len(chunk)
        verifies += 1
        accepted += n
    return len(out), steps, verifies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=1.45, help="c_verify[k+1] / c_step (spec-edge bench prints it)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cache", default=str(ROOT / "bench" / "results" / "greedy_outputs.json"))
    parser.add_argument("--variants", nargs="+", default=None,
                        help="name=break_even:prior_accepted:prior_proposals (default: a built-in set)")
    args = parser.parse_args()

    from spec_edge.runtime.serving import front_of
    from spec_edge.runtime.drafters.ngram import NgramDrafter
    from spec_edge.tools.prompts import load_prompts

    prompts = load_prompts()
    cache = Path(args.cache)
    data = json.loads(cache.read_text()) if cache.is_file() else {}
    key = str(args.max_new_tokens)
    if key not in data or set(data[key]) != {p["id"] for p in prompts}:
        from spec_edge.config import Config
        from spec_edge import artifacts
        from spec_edge.runtime.requests import GenerateRequest
        from spec_edge.runtime.scheduler import run_one

        engine = artifacts.engine(Config().replace(**{"speculative.drafter": "none"}),
                                    lambda m: print(m, file=sys.stderr))
        data[key] = {}
        for p in prompts:
            request = GenerateRequest(prompt=p["prompt"], max_new_tokens=args.max_new_tokens, temperature=0.0,
                                      speculate=False)
            result = run_one(engine, request)
            data[key][p["id"]] = {"prompt_ids": front_of(engine).prompt_ids(request), "out": result.token_ids,
                                  "kind": p["kind"]}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(data))
    records = data[key]
    variants = {"current": NgramDrafter().__dict__}
    default = NgramDrafter()
    specs = args.variants or ["current=%g:%g:%g" % (default.break_even, default.prior_accepted, default.prior_proposals),
                              "prior1=0.6:1:1", "prior05=0.6:0.5:1", "no-gate=-1:2:1", "be0.8=0.8:2:1"]
    variants = {}
    for spec in specs:
        name, values = spec.split("=")
        be, pa, pp = (float(x) for x in values.split(":"))
        variants[name] = dict(break_even=be, prior_accepted=pa, prior_proposals=pp)
    print(f"k={args.k}, verify/step cost ratio {args.ratio}; speed-up per prompt (tokens, steps, verifies)")
    header = f"{'prompt':14s} {'kind':14s} " + " ".join(f"{name:>10s}" for name in variants)
    print(header)
    per_kind: dict[str, dict[str, list[float]]] = {}
    for pid, rec in records.items():
        cells = []
        for name, kw in variants.items():
            tokens, steps, verifies = replay(NgramDrafter(**kw), rec["prompt_ids"], rec["out"], args.k)
            speed = (tokens - 1) / (steps + args.ratio * verifies) if tokens > 1 else 1.0
            per_kind.setdefault(rec["kind"], {}).setdefault(name, []).append(speed)
            cells.append(f"{speed:10.2f}")
        print(f"{pid:14s} {rec['kind']:14s} " + " ".join(cells))
    print("per kind (min / median):")
    for kind, by in sorted(per_kind.items()):
        print(f"{'':14s} {kind:14s} " + " ".join(f"{min(v):4.2f}/{statistics.median(v):4.2f}" for v in by.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
