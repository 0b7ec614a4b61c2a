"""Acceptance and tok/s of eagle3 / hybrid through the dynamic-width graphs TensorRT is given
(`spec-edge build config/smollm2_trt_eagle3.yaml --export-only`, run by ONNX Runtime:
runtime/backends/ort_dynamic.py) side by side with the static ONNX Runtime graphs of the same
target and head, on the same prompt ids, in one run. Rounds are interleaved per prompt (every system
and drafter on one prompt, then the next), so the load of a shared machine hits all alike; each
speculative run is checked to give its own target-only token ids, and the dynamic target-only ids
are checked against the static ones.

    PYTHONPATH=$PWD .venv/bin/python scripts/measure_dynamic.py --engine-dir /tmp/wt17b_engines \
        --ks 2 3 --limit 2 --max-new-tokens 64

static variants: graph-fp32 = the exported static graphs as they are (graphs.ort_attention: graph,
graphs.head_weights: fp32: the same arithmetic as the dynamic files), fused-q8 = ONNX Runtime's
default passes (fused attention, 8-bit head).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from spec_edge.config import load
from spec_edge.device import builder
from spec_edge.graphs import export, hidden
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.ort_dynamic import OrtDynamicHead, OrtDynamicRunner
from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
from spec_edge.runtime.drafters.hybrid import HybridDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.tools.prompts import load_prompts

VARIANTS = {"graph-fp32": {"graphs.ort_attention": "graph", "graphs.head_weights": "fp32"},
            "fused-q8": {"graphs.ort_attention": "fused", "graphs.head_weights": "q8"}}


def dynamic_system(cfg, ks):
    target_dir = builder.export_only(cfg, progress=lambda m: print(m, file=sys.stderr)).parent / "target"
    runner = OrtDynamicRunner(target_dir, [1] + [k + 1 for k in ks], cfg.runtime.threads)
    head = OrtDynamicHead(export.artifact_dir(cfg, "eagle3"), runner.embed_table, cfg.runtime.threads)
    cols = hidden.hidden_columns(hidden.returned_hidden_layers(target_dir), head.cfg.aux_layers,
                                 runner.model_cfg.hidden_size)
    s = cfg.speculative
    return SimpleNamespace(target=runner, drafters={
        "eagle3": Eagle3Drafter(runner, head, cols),
        "hybrid": HybridDrafter(NgramDrafter(ngram_min=s.ngram_min, ngram_max=s.ngram_max),
                                Eagle3Drafter(runner, head, cols))})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="config/smollm2_trt_eagle3.yaml")
    p.add_argument("--engine-dir", default="engines")
    p.add_argument("--prompts", default="data/eval_prompts.jsonl")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--limit", type=int, default=2, help="prompts per kind")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    cfg = load(args.profile).replace(**{"runtime.engine_dir": args.engine_dir, "runtime.threads": args.threads})
    systems = {"dynamic": dynamic_system(cfg, args.ks)}
    static = cfg.replace(**{"runtime.backend": "onnxruntime", "runtime.profile": cfg.runtime.profile + "-static",
                            "graphs.k_values": sorted(args.ks), "speculative.k": min(args.ks)})  # verify graphs: --ks
    for name in args.variants:
        engine = Engine.from_config(static.replace(**VARIANTS[name]), progress=lambda m: print(m, file=sys.stderr))
        systems[f"static:{name}"] = SimpleNamespace(target=engine.target, engine=engine, drafters={
            d: engine.drafter(d) for d in ("eagle3", "hybrid")})
    first = next(s.engine for s in systems.values() if hasattr(s, "engine"))
    per_kind: dict[str, int] = defaultdict(int)
    prompts = []
    for q in load_prompts(Path(args.prompts)):
        per_kind[q["kind"]] += 1
        if per_kind[q["kind"]] <= args.limit:
            prompts.append(q)
    agg = defaultdict(lambda: defaultdict(float))
    problems = []
    for i, q in enumerate(prompts):
        ids = first.prompt_ids(GenerateRequest(prompt=q["prompt"]))
        plain_ids = {}
        for sname, system in systems.items():
            for drafter, k in [("none", 0)] + [(d, k) for d in ("eagle3", "hybrid") for k in args.ks]:
                out, _, st = speculative.generate(system.target, ids, max_new_tokens=args.max_new_tokens,
                                                  eos_ids=first.eos_ids, drafter=system.drafters.get(drafter), k=k)
                if drafter == "none":
                    plain_ids[sname] = out
                elif out != plain_ids[sname]:
                    problems.append(f"{sname} {drafter} k={k} != its target-only on prompt {i}")
                a = agg[(sname, drafter, k)]
                for key in ("drafted", "accepted", "verify_calls"):
                    a[key] += getattr(st, key)
                a["tokens"] += max(st.new_tokens - 1, 0)
                a["seconds"] += st.total_time_s - st.time_to_first_token_s
        if len({tuple(v) for v in plain_ids.values()}) > 1:
            problems.append(f"target-only ids differ between systems on prompt {i}")
        print(f"[measure] {i + 1}/{len(prompts)} {q['kind']}", file=sys.stderr)
    tok_s = {key: a["tokens"] / a["seconds"] if a["seconds"] else 0.0 for key, a in agg.items()}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy; tok/s of decoding after the first token")
    print(f"{'system':18} {'drafter':8} {'k':>2} {'accept':>7} {'MAL':>5} {'tok/s':>7} {'x plain':>8} {'dyn/static':>10}")
    for (sname, drafter, k), a in agg.items():
        acc = f"{a['accepted'] / a['drafted']:.3f}" if a["drafted"] else "-"
        mal = f"{(a['accepted'] + a['verify_calls']) / a['verify_calls']:.2f}" if a["verify_calls"] else "-"
        vs = "" if sname == "dynamic" else f"{tok_s[('dynamic', drafter, k)] / tok_s[(sname, drafter, k)]:.2f}"
        print(f"{sname:18} {drafter:8} {k:>2} {acc:>7} {mal:>5} {tok_s[(sname, drafter, k)]:7.1f} "
              f"{tok_s[(sname, drafter, k)] / tok_s[(sname, 'none', 0)]:8.2f} {vs:>10}")
    print("exactness: " + ("every speculative run == its target-only greedy; target-only ids equal across systems"
                           if not problems else "; ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
