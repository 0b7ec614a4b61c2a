"""`spec-edge bench --guided`: constrained decoding on robot commands with JSON Schemas
(bench/robot_schemas.jsonl), side by side in one run.

For each drafter (none and the --drafters asked) three variants run on every prompt, greedy:
  free            no schema (how often the model's own answer is valid JSON of the schema)
  guided          the schema; drafts cut at the first forbidden token, verify rows masked
  guided+forced   the schema, and the grammar's forced tokens proposed as drafts (free, accepted)
in an order rotated each round, so load on a shared machine hits all alike. Validity (eos and the
text valid against the schema, checked by tools/schema_check.py, not by the grammar engine) must be
100% for the guided variants; their token ids must be the same for every drafter and variant (the
guided target-only run is the reference). Speed: median tok/s, and the within-round ratio to the
same variant's drafter-none run.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "bench" / "robot_schemas.jsonl"
VARIANTS = ("free", "guided", "guided+forced")


def load_schema_prompts(path: Path | None = None, quick: bool = False) -> list[dict]:
    """{"id", "kind", "prompt", "schema", "quick"?} per line; # lines and blank lines skipped."""
    path = Path(path) if path else DEFAULT_FILE
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        entry = json.loads(line)
        if not isinstance(entry.get("prompt"), str) or not isinstance(entry.get("schema"), dict):
            raise ValueError(f"{path}:{number}: needs a 'prompt' string and a 'schema' object")
        entries.append(entry)
    quick_ones = [e for e in entries if e.get("quick")]
    return quick_ones if quick and quick_ones else entries


def main(cfg, args, progress) -> int:
    from spec_edge.config import speculative_k
    from spec_edge import artifacts
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one
    from spec_edge.tools.schema_check import valid_json

    full = getattr(args, "full", False)
    prompts = load_schema_prompts(Path(args.prompts) if args.prompts else None, quick=not full)
    repeats = args.repeats or (3 if full else 1)
    drafters = ["none"] + [d for d in args.drafters if d != "none"]
    k = (args.ks or [speculative_k(cfg)])[0]
    engine = artifacts.engine(cfg, progress)
    progress(f"[bench] guided: {len(prompts)} prompts, drafters {drafters}, k {k}, {repeats} repeat(s), "
             f"max_new_tokens {args.max_new_tokens}")
    systems = [(d, v) for d in drafters for v in VARIANTS]

    def request(entry, drafter, variant, max_new):
        return GenerateRequest(prompt=entry["prompt"], drafter=drafter, k=k, max_new_tokens=max_new,
                               json_schema=json.dumps(entry["schema"]) if variant != "free" else "",
                               forced_drafts=variant == "guided+forced")

    for entry in prompts:  # warm-up, and every schema compiled before timing (as the node's validation does)
        for drafter, variant in systems:
            run_one(engine, request(entry, drafter, variant, 8))
    runs = []
    for rep in range(repeats):
        for i, entry in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(systems)
            for drafter, variant in systems[shift:] + systems[:shift]:
                result = run_one(engine, request(entry, drafter, variant, args.max_new_tokens))
                ok, why = valid_json(result.text, entry["schema"])
                s = result.stats
                runs.append(dict(id=entry["id"], repeat=rep, drafter=drafter, variant=variant, ids=result.token_ids,
                                 finish=result.finish_reason, valid=ok and result.finish_reason == "eos", why=why,
                                 text=result.text, tok_s=s.tokens_per_s, drafted=s.drafted, accepted=s.accepted,
                                 forced=s.forced, cut=s.cut, verify=s.verify_calls, steps=s.step_calls,
                                 new=s.new_tokens))
        progress(f"[bench] guided round {rep + 1}/{repeats} done")
    report = summarize(runs, drafters)
    report.update(k=k, max_new_tokens=args.max_new_tokens, repeats=repeats, prompts=[p["id"] for p in prompts],
                  command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print(format_table(report))
    out = Path(args.json_out) if args.json_out else Path("bench") / "results" / "bench-guided.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    progress(f"[bench] wrote {out}")
    bad = [r for r in report["rows"] if r["variant"] != "free" and r["validity"] < 1.0]
    return 1 if bad or report["mismatches"] else 0


def summarize(runs: list[dict], drafters: list[str]) -> dict:
    reference = {(r["id"], r["repeat"]): r["ids"] for r in runs if r["drafter"] == "none" and r["variant"] == "guided"}
    free_ref = {(r["id"], r["repeat"]): r["ids"] for r in runs if r["drafter"] == "none" and r["variant"] == "free"}
    mismatches = [dict(id=r["id"], drafter=r["drafter"], variant=r["variant"]) for r in runs
                  if r["ids"] != (free_ref if r["variant"] == "free" else reference)[(r["id"], r["repeat"])]]
    base = {(r["id"], r["repeat"], r["variant"]): r["tok_s"] for r in runs if r["drafter"] == "none"}
    rows = []
    for drafter in drafters:
        for variant in VARIANTS:
            mine = [r for r in runs if r["drafter"] == drafter and r["variant"] == variant]
            drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
            verify, steps, new = (sum(r[key] for r in mine) for key in ("verify", "steps", "new"))
            ratios = [r["tok_s"] / base[(r["id"], r["repeat"], "free")] for r in mine
                      if base.get((r["id"], r["repeat"], "free"))]
            rows.append(dict(drafter=drafter, variant=variant, runs=len(mine),
                             validity=sum(r["valid"] for r in mine) / len(mine),
                             tok_s=statistics.median(r["tok_s"] for r in mine),
                             vs_free_none=statistics.median(ratios) if ratios else None,
                             acceptance=accepted / drafted if drafted else 0.0,
                             mean_accepted_length=(accepted + verify) / verify if verify else 0.0,
                             tokens_per_call=(new - len(mine)) / (verify + steps) if verify + steps else 0.0,
                             forced=sum(r["forced"] for r in mine), cut=sum(r["cut"] for r in mine),
                             new_tokens=new))
    invalid = [dict(id=r["id"], drafter=r["drafter"], variant=r["variant"], why=r["why"], text=r["text"][:120])
               for r in runs if r["variant"] != "free" and not r["valid"]]
    return dict(rows=rows, mismatches=mismatches, invalid=invalid,
                free_examples={r["id"]: r["text"][:160] for r in runs
                               if r["drafter"] == "none" and r["variant"] == "free"})


def format_table(report: dict) -> str:
    lines = [f"guided decoding, k={report['k']}, max_new_tokens {report['max_new_tokens']}, "
             f"{len(report['prompts'])} prompts x {report['repeats']} repeat(s)",
             "| drafter | variant | valid | tok/s | x (none, free) | acceptance | tokens/verify | tokens/target call "
             "| forced | cut |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = "-" if r["vs_free_none"] is None else f"{r['vs_free_none']:.2f}"
        lines.append(f"| {r['drafter']} | {r['variant']} | {r['validity']:.0%} | {r['tok_s']:.1f} | {ratio} | "
                     f"{r['acceptance']:.2f} | {r['mean_accepted_length']:.2f} | {r['tokens_per_call']:.2f} | "
                     f"{r['forced']} | {r['cut']} |")
    lines.append("exact (guided ids identical for every drafter and variant; free ids for every drafter): "
                 + ("yes" if not report["mismatches"] else f"NO: {report['mismatches']}"))
    for bad in report["invalid"]:
        lines.append(f"INVALID guided output: {bad}")
    return "\n".join(lines)
