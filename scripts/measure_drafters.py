"""Acceptance, mean accepted length and tok/s of drafters vs target-only greedy decoding, on held-out
prompts (data/eval_prompts.jsonl), per prompt kind and k. Every speculative run is checked to give
the target-only token ids. Runs are interleaved per prompt (target-only, then each drafter x k) so the
load of this shared machine hits all alike; ratios are taken within each prompt's round.

    .venv/bin/python scripts/measure_drafters.py --head heads/smollm2-135m-eagle3 \
        --medusa-head heads/smollm2-135m-medusa --peagle-head heads/smollm2-135m-peagle \
        --draft-model heads/smollm2-135m-draft4 --profile smollm2-135m-heads \
        --drafters eagle3 hybrid medusa peagle draft ngram layerskip --ks 2 3 4 5 --json-out /tmp/drafters.json

Drafters whose head or model is not given are left out (with a note).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from spec_edge.config import Config
from spec_edge.runtime import speculative
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.tools.prompts import load_prompts


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--head", default="", help="EAGLE-3 head folder (drafters eagle3 and hybrid)")
    p.add_argument("--medusa-head", default="", help="Medusa heads folder")
    p.add_argument("--peagle-head", default="", help="parallel-drafting (P-EAGLE) head folder")
    p.add_argument("--draft-model", default="", help="separate draft model (HF folder, e.g. train-draft --kind draft)")
    p.add_argument("--profile", default="smollm2-135m-eagle3",
                   help="artifact folder (graphs with the hidden outputs of every given head)")
    p.add_argument("--prompts", default="data/eval_prompts.jsonl")
    p.add_argument("--drafters", nargs="+", default=["eagle3", "ngram", "layerskip"])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--other-ks", type=int, nargs="+", help="k values for drafters without a head (default --ks)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--kinds", nargs="+")
    p.add_argument("--limit", type=int, default=0, help="prompts per kind (0 = all)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = one per core)")
    p.add_argument("--head-weights", nargs="+", choices=("q8", "fp32"),
                   help="graphs.head_weights of the head drafters; two values measure both side by side "
                        "(rows 'eagle3@fp32' ...; default: the config's)")
    p.add_argument("--json-out")
    args = p.parse_args()
    given = {"eagle3": args.head, "hybrid": args.head, "medusa": args.medusa_head, "peagle": args.peagle_head, "draft": args.draft_model}
    for name, path in given.items():
        if name in args.drafters and not path:
            print(f"[measure] {name}: no head/model given, left out", file=sys.stderr)
    args.drafters = [d for d in args.drafters if d not in given or given[d]]
    cfg = Config().replace(**{"runtime.profile": args.profile, "graphs.k_values": sorted(set(args.ks) | set(args.other_ks or ())),
                              "speculative.eagle3_head": args.head, "speculative.medusa_head": args.medusa_head,
                              "speculative.peagle_head": args.peagle_head, "model.draft": args.draft_model,
                              "speculative.drafter": "none", "speculative.k": args.ks[0],
                              "runtime.threads": args.threads})
    engine = Engine.from_config(cfg, progress=lambda m: print(m, file=sys.stderr))
    prompts = load_prompts(Path(args.prompts), args.kinds)
    if args.limit:
        per_kind: dict[str, int] = defaultdict(int)
        kept = []
        for q in prompts:
            if per_kind[q["kind"]] < args.limit:
                kept.append(q)
                per_kind[q["kind"]] += 1
        prompts = kept
    heads = ("eagle3", "hybrid", "medusa", "peagle")
    drafters = {d: engine.drafter(d) for d in args.drafters if d not in heads}
    head_weights = args.head_weights or [cfg.graphs.head_weights]
    for weights in head_weights:  # each head drafter once per head weights (a fresh head each)
        engine.use_head_weights(weights)
        for d in args.drafters:
            if d in heads:
                drafters[d if len(head_weights) == 1 else f"{d}@{weights}"] = engine.drafter(d)
    systems = [("none", 0)] + [(d, k) for d in drafters
                               for k in (args.ks if d.split("@")[0] in heads or not args.other_ks else args.other_ks)]
    agg = defaultdict(lambda: defaultdict(float))
    ratios = defaultdict(list)
    mismatches = []
    for i, q in enumerate(prompts):
        ids = engine.prompt_ids(GenerateRequest(prompt=q["prompt"]))
        base_ids, _, base = speculative.generate(engine.target, ids, max_new_tokens=args.max_new_tokens,
                                                 eos_ids=engine.eos_ids)
        base_tps = base.tokens_per_s
        for name, k in systems:
            if name == "none":
                out, stats = base_ids, base
            else:
                out, _, stats = speculative.generate(engine.target, ids, max_new_tokens=args.max_new_tokens,
                                                     eos_ids=engine.eos_ids, drafter=drafters[name], k=k)
                if out != base_ids:
                    mismatches.append((q["prompt"][:40], name, k))
                ratios[(q["kind"], name, k)].append(stats.tokens_per_s / base_tps if base_tps else 0.0)
            a = agg[(q["kind"], name, k)]
            a["drafted"] += stats.drafted
            a["accepted"] += stats.accepted
            a["verify_calls"] += stats.verify_calls
            a["target_calls"] += stats.verify_calls + stats.step_calls
            a["new_tokens"] += max(stats.new_tokens - 1, 0)
            a["decode_s"] += stats.total_time_s - stats.time_to_first_token_s
            a["draft_s"] += stats.draft_time_s
            if name != "none" and hasattr(drafters[name], "proposals"):  # hybrid: drafts per source
                for source, n in drafters[name].proposals.items():
                    a[f"drafts_{source}"] += n
        print(f"[measure] {i + 1}/{len(prompts)} {q['kind']}: plain {base_tps:.1f} tok/s", file=sys.stderr)
    rows = []
    for (kind, name, k), a in sorted(agg.items()):
        row = {"kind": kind, "drafter": name, "k": k,
               "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
               "mean_accepted_length": (a["accepted"] + a["verify_calls"]) / a["verify_calls"] if a["verify_calls"] else None,
               "tok_s": a["new_tokens"] / a["decode_s"] if a["decode_s"] else None,
               "tokens_per_target_call": a["new_tokens"] / a["target_calls"] if a["target_calls"] else None,
               "draft_ms_per_token": 1000 * a["draft_s"] / a["new_tokens"] if a["new_tokens"] else None,
               "speedup_median": statistics.median(ratios[(kind, name, k)]) if ratios[(kind, name, k)] else 1.0}
        row.update({key: int(v) for key, v in a.items() if key.startswith("drafts_")})
        rows.append(row)
    print(f"{'kind':10} {'drafter':12} {'k':>2} {'accept':>7} {'MAL':>5} {'tok/s':>6} {'x plain':>7} {'draft ms/tok':>12} "
          f"{'tok/call':>8}")
    for r in rows:
        def f(v, spec):
            return "-" if v is None else format(v, spec)
        print(f"{r['kind']:10} {r['drafter']:12} {r['k']:>2} {f(r['acceptance'], '.2f'):>7} "
              f"{f(r['mean_accepted_length'], '.2f'):>5} {f(r['tok_s'], '.1f'):>6} {r['speedup_median']:>7.2f} "
              f"{f(r['draft_ms_per_token'], '.1f'):>12} {f(r['tokens_per_target_call'], '.2f'):>8}")
    for r in rows:
        sources = {key[len("drafts_"):]: v for key, v in r.items() if key.startswith("drafts_")}
        if sources:
            print(f"{r['kind']:10} {r['drafter']:12} {r['k']:>2} verifies drafted by: "
                  + ", ".join(f"{source} {n}" for source, n in sources.items()))
    print(f"exactness: {'all speculative runs == target-only greedy' if not mismatches else mismatches}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "mismatches": mismatches,
                                                   "args": vars(args)}, indent=1))
    return 0 if not mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
