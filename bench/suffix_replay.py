"""Replay recorded greedy answers through the drafters without the model: greedy speculative decoding emits the
target-only tokens, so which verify calls and plain steps a drafter causes depends only on them. Two workloads,
each replayed in its order so the suffix store grows as it would (one store per variant and workload):

  shift    the robot shift's target-only answers (bench/results/robot_shift.json, written by bench/robot_shift.py)
  prompts  bench/prompts.jsonl, unrelated to one another (greedy target-only answers of the default profile,
           recorded once into --cache)

Every iteration the drafter alone decides (no k auto, no grammar-forced drafts): a draft costs one verify call of
width k+1, silence one plain step. Per template / prompt kind: tokens per target call, and the speed-up over
target-only priced with the verify/step cost ratio r (bench/verify_width.py measures it):

    speed-up = (tokens - 1) / (plain steps + r * verify calls)

    PYTHONPATH=$PWD .venv/bin/python bench/suffix_replay.py [--k 4] [--ratio 1.3] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import robot_shift  # noqa: E402

from spec_edge.config import Config  # noqa: E402
from spec_edge.runtime.drafters import suffix  # noqa: E402
from spec_edge.runtime.drafters.ngram import Gate, NgramDrafter  # noqa: E402
from spec_edge.runtime.requests import GenerateRequest  # noqa: E402


def shift_answers(engine, shift: Path) -> list[tuple[str, list[int], list[int]]]:
    """(template, prompt ids, greedy answer ids) of the shift's target-only requests, in its order."""
    from spec_edge.runtime.serving import front_of
    from spec_edge.runtime.tool_format import tools_from_json
    tools = tools_from_json(json.dumps(robot_shift.TOOLS))
    out = []
    for row in json.loads(shift.read_text())["rows"]:
        if row["drafter"] == "none":
            body = robot_shift.TEMPLATES[row["template"]](row["round"])
            request = GenerateRequest(messages=tuple((m["role"], m["content"]) for m in body["messages"]),
                                      tools=tools if "tools" in body else ())
            out.append((row["template"], front_of(engine).prompt_ids(request), row["token_ids"]))
    return out


def prompt_answers(engine, cache: Path, max_new_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(kind, prompt ids, greedy answer ids) of bench/prompts.jsonl, decoded once (target-only) into cache."""
    from spec_edge.runtime.scheduler import run_one
    from spec_edge.runtime.serving import front_of
    from spec_edge.tools.prompts import load_prompts
    data = json.loads(cache.read_text()) if cache.is_file() else {}
    key = str(max_new_tokens)
    prompts = load_prompts()
    if {p["id"] for p in prompts} != set(data.get(key, {})):
        data[key] = {}
        for p in prompts:
            request = GenerateRequest(prompt=p["prompt"], max_new_tokens=max_new_tokens, temperature=0.0,
                                      speculate=False)
            data[key][p["id"]] = {"kind": p["kind"], "prompt_ids": front_of(engine).prompt_ids(request),
                                  "out": run_one(engine, request).token_ids}
        cache.write_text(json.dumps(data))
    return [(p["kind"], data[key][p["id"]]["prompt_ids"], data[key][p["id"]]["out"]) for p in prompts]


def replay(make, answers: list, k: int) -> dict[str, list[int]]:
    """Group -> [tokens, plain steps, verify calls] with drafter make() per request (prefill's token not counted)."""
    totals: dict[str, list[int]] = {}
    for group, prompt, output in answers:
        drafter = make()
        drafter.start(list(prompt))
        seq, pos, steps, verifies = list(prompt) + output[:1], 1, 0, 0
        while pos < len(output):
            draft = drafter.propose(seq, k, None)
            n = 0
            if draft is None:
                steps += 1
            else:
                verifies += 1
                while n < len(draft.tokens) and pos + n < len(output) and draft.tokens[n] == output[pos + n]:
                    n += 1
                drafter.observe(len(draft.tokens), n)
            chunk = output[pos:pos + n + 1]
            seq += chunk
            pos += len(chunk)
        drafter.finish()
        total = totals.setdefault(group, [0, 0, 0])
        for i, v in enumerate((len(output) - 1, steps, verifies)):
            total[i] += v
    return totals


def suffix_variant(gate_match: int | None, factor: float = 2.0, min_prob: float = 0.1):
    """A factory of suffix drafters over one fresh store; gate_match None = no gate (every match drafts)."""
    store = suffix.SuffixStore(256, 32)

    def make():
        drafter = suffix.SuffixDrafter(store, 32, factor, min_prob)
        drafter.start = functools.partial(start, drafter)
        return drafter

    def start(drafter, prompt_ids):
        suffix.SuffixDrafter.start(drafter, prompt_ids)
        if gate_match is None:
            drafter._gate = Gate(break_even=-1.0)
        suffix.GATE_MATCH = gate_match or 2
    return make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shift", default=str(ROOT / "bench" / "results" / "robot_shift.json"))
    parser.add_argument("--cache", default=str(ROOT / "bench" / "results" / "greedy_outputs_q4.json"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=1.3, help="c_verify[k+1] / c_step on the profile")
    args = parser.parse_args()
    from spec_edge import artifacts
    engine = artifacts.engine(Config().replace(**{"speculative.drafter": "none"}), lambda m: print(m, file=sys.stderr))
    workloads = {"shift": shift_answers(engine, Path(args.shift)),
                 "prompts": prompt_answers(engine, Path(args.cache), args.max_new_tokens)}
    variants = {"ngram": lambda: NgramDrafter,
                "suffix, no gate": lambda: suffix_variant(None),
                "suffix, gate n<=2": lambda: suffix_variant(2),
                "suffix, gate n<=3": lambda: suffix_variant(3),
                "suffix, gate n<=4": lambda: suffix_variant(4),
                "suffix, gate n<=8": lambda: suffix_variant(8)}
    print(f"k={args.k}, verify/step cost ratio r={args.ratio}; per group: tokens per target call / priced speed-up")
    for workload, answers in workloads.items():
        groups = list(dict.fromkeys(group for group, _, _ in answers))
        print(f"\n{workload} ({len(answers)} answers)       " + "  ".join(f"{g:>15s}" for g in groups + ["all"]))
        for name, variant in variants.items():
            totals = replay(variant(), answers, args.k)
            totals["all"] = [sum(t[i] for t in totals.values()) for i in range(3)]
            cells = []
            for g in groups + ["all"]:
                tokens, steps, verifies = totals[g]
                per_call, speed = tokens / max(1, steps + verifies), tokens / max(1, steps + args.ratio * verifies)
                cells.append(f"{per_call:6.2f} / {speed:5.2f}")
            print(f"{name:24s} " + "  ".join(f"{c:>15s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
