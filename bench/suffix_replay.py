"""Replay a robot shift's greedy answers (bench/results/robot_shift.json, written by bench/robot_shift.py) through
drafters without the model: greedy speculative decoding emits the target-only tokens, so what a drafter would have
had accepted depends only on them. Prints tokens per target call per template for n-gram and suffix variants
(suffix_spec_factor x suffix_min_prob), every iteration drafting k tokens (no k auto, no grammar-forced drafts: the
drafter alone), answers replayed in the shift's order so the suffix store grows as it did.

    PYTHONPATH=$PWD .venv/bin/python bench/suffix_replay.py [--shift bench/results/robot_shift.json] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import robot_shift  # noqa: E402

from spec_edge.config import Config  # noqa: E402
from spec_edge.runtime.backends.onnxruntime import ort_folder  # noqa: E402
from spec_edge.runtime.drafters.ngram import NgramDrafter  # noqa: E402
from spec_edge.runtime.drafters.suffix import SuffixDrafter, SuffixStore  # noqa: E402
from spec_edge.runtime.front import Capabilities, Front  # noqa: E402
from spec_edge.runtime.requests import GenerateRequest  # noqa: E402
from spec_edge.runtime.tokenizer import Tokenizer  # noqa: E402
from spec_edge.runtime.tool_format import tools_from_json  # noqa: E402


def answers(shift: Path) -> list[tuple[str, list[int], list[int]]]:
    """(template, prompt ids, greedy answer ids) of the shift's target-only requests, in its order."""
    cfg = Config()
    tokenizer = Tokenizer(ort_folder(cfg, "target"))
    caps = Capabilities(name="replay", drafters=("none",), k_values=(), k_remedy="", max_context=1 << 20,
                        max_input=1 << 20, vocab_size=1 << 20, eos_ids=())
    front = Front(cfg, tokenizer, caps, lambda kind, text: None)
    tools = tools_from_json(json.dumps(robot_shift.TOOLS))
    out = []
    for row in json.loads(shift.read_text())["rows"]:
        if row["drafter"] == "none":
            body = robot_shift.TEMPLATES[row["template"]](row["round"])
            request = GenerateRequest(messages=tuple((m["role"], m["content"]) for m in body["messages"]),
                                      tools=tools if "tools" in body else ())
            out.append((row["template"], front.prompt_ids(request), row["token_ids"]))
    return out


def replay(make, shift: list, k: int) -> dict[str, float]:
    """Template -> tokens per target call (prefill's first token included) with drafter make() per request."""
    totals: dict[str, list[int]] = {}
    for template, prompt, output in shift:
        drafter = make()
        drafter.start(list(prompt))
        seq, pos, calls = list(prompt) + output[:1], 1, 1
        while pos < len(output):
            draft = drafter.propose(seq, k, None)
            n = 0
            if draft is not None:
                while n < len(draft.tokens) and pos + n < len(output) and draft.tokens[n] == output[pos + n]:
                    n += 1
                drafter.observe(len(draft.tokens), n)
            chunk = output[pos:pos + n + 1]
            seq += chunk
            pos, calls = pos + len(chunk), calls + 1
        drafter.finish()
        total = totals.setdefault(template, [0, 0])
        total[0], total[1] = total[0] + len(output), total[1] + calls
    return {template: tokens / calls for template, (tokens, calls) in totals.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shift", default=str(ROOT / "bench" / "results" / "robot_shift.json"))
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    shift = answers(Path(args.shift))
    rows = {"ngram": replay(NgramDrafter, shift, args.k)}
    for factor in (1.0, 2.0, 4.0):
        for min_prob in (0.1, 0.3):
            store = SuffixStore(256, 32)
            rows[f"suffix x{factor:g} p>={min_prob:g}"] = replay(
                lambda: SuffixDrafter(store, 32, factor, min_prob), shift, args.k)
    templates = list(rows["ngram"])
    print(f"tokens per target call, k={args.k}, {len(shift)} answers: " + "  ".join(f"{t:>8s}" for t in templates))
    for name, by in rows.items():
        print(f"{name:24s} " + "  ".join(f"{by[t]:8.2f}" for t in templates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
