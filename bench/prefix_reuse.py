"""Prefix reuse across requests (serve.reuse_prefix) on the embedded default, cold vs reused in one
process, interleaved:

1. time to first token for a long system prompt (robot description, tools, safety rules; about
   --system-tokens tokens) + a short question: cold (prefill from 0) vs reused (the system prompt's
   rows kept from before: Engine.warm, then the request); medians over --repeats questions.
2. a --turns-turn dialog (a shorter system prompt, each turn's question + the answers so far): per-turn
   TTFT cold vs reused, medians over --repeats dialogs.
3. exactness: every reused answer above and a grid of --systems system prompts x --exact-turns turns of
   bench/prompts.jsonl questions against the cold answer, token for token; a difference counts as a
   near-tie only where the cold run's top-2 logit margin at the first differing token is below --margin.

    PYTHONPATH=$PWD .venv/bin/python bench/prefix_reuse.py [--weights fp32|q4_fp32act|q4] [--drafter ngram]

The default profile's max_context is 1024: a 900-token system prompt leaves room for the question and
a 48-token answer; --max-context 2048 --system-tokens 1000 exports a larger profile of its own
(<profile>-ctx2048) for the 1,000-token case.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from spec_edge.config import Config
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.tools.prompts import load_prompts

REPO = Path(__file__).resolve().parents[1]
ROBOT = ("You are the voice and planner of RB-7, a wheeled mobile manipulator working in a hospital "
         "supply room. It has a 6-axis arm with a parallel gripper (maximum payload 2 kg), a lidar, two "
         "depth cameras and a battery that lasts about six hours. Answer briefly and precisely.")
TOOLS = ["move_base(x, y, theta): drive to a pose on the map, in metres and radians",
         "move_arm(x, y, z, roll, pitch, yaw): move the gripper to a pose in the base frame",
         "open_gripper(width): open the gripper to a width in millimetres",
         "close_gripper(force): close the gripper with a force in newtons",
         "scan_shelf(shelf_id): return the items the cameras see on a shelf",
         "read_battery(): return the charge in percent and the minutes left",
         "dock(): drive to the charging dock and start charging",
         "say(text): speak a sentence through the loudspeaker",
         "wait(seconds): do nothing for a while",
         "report(text): send a status message to the operator console"]
RULES = ["never move the arm while a person stands within one metre",
         "never carry more than 2 kg",
         "stop at once when the emergency stop topic says so",
         "drive at most 0.5 metres per second in corridors",
         "ask the operator before entering a patient room",
         "dock when the battery falls below 15 percent",
         "keep sterile items apart from waste",
         "report every dropped item"]
PLACES = ["shelf A1", "shelf A2", "shelf B1", "shelf B4", "the corridor", "the nurse station",
          "the charging dock", "the elevator", "room 12", "the waste bin"]
QUESTIONS = ["Which tool checks the battery?", "Pick up the gauze from shelf A2.", "Is it safe to move the arm now?",
             "Drive to the nurse station.", "What is the maximum payload?", "Report that shelf B1 is empty.",
             "How fast may you drive in the corridor?", "Open the gripper to 40 millimetres.",
             "What do you do when the battery is low?", "Put the syringes on shelf B4.",
             "Say hello to the nurse.", "Which rule covers patient rooms?"]


def system_prompt(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """The robot description, its tools and rules, then inventory lines until about n_tokens tokens."""
    rng = np.random.default_rng(seed)
    tools, rules = list(TOOLS), list(RULES)
    rng.shuffle(tools)
    rng.shuffle(rules)
    text = ROBOT + "\nTools:\n" + "\n".join(f"- {t}" for t in tools) + "\nSafety rules:\n" + \
        "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rules)) + "\nInventory:"
    item = 0
    while len(tokenizer.encode(text)) < n_tokens:
        place = PLACES[int(rng.integers(len(PLACES)))]
        text += f"\n- item {item}: {int(rng.integers(1, 40))} boxes of supply {int(rng.integers(100, 999))} on {place}"
        item += 1
    return text


def run(engine: Engine, reuse: bool, request: GenerateRequest):
    engine.cfg = engine.cfg.replace(**{"serve.reuse_prefix": reuse})
    return engine.generate(request)


def warm(engine: Engine, system: str) -> None:
    """The system prompt's rows in the cache, as any earlier request with it leaves them."""
    engine.cfg = engine.cfg.replace(**{"serve.reuse_prefix": True})
    engine.warm(system)


def margin(engine: Engine, prompt_ids: list[int], cold_ids: list[int], at: int) -> float:
    """Top-2 logit gap of the target for cold token `at` (the cache is rewritten: its record is cleared)."""
    logits = engine.target.prefill(prompt_ids + cold_ids[:at], 0)
    engine.target.held = ()
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


class Exactness:
    def __init__(self, engine: Engine, limit: float):
        self.engine, self.limit = engine, limit
        self.same = self.near_ties = 0
        self.real: list[str] = []
        self.margins: list[float] = []

    def check(self, request: GenerateRequest, reused, cold) -> None:
        if reused.token_ids == cold.token_ids:
            self.same += 1
            return
        at = next(i for i, (a, b) in enumerate(zip(reused.token_ids + [-1], cold.token_ids + [-2])) if a != b)
        gap = margin(self.engine, self.engine.prompt_ids(request), cold.token_ids, at)
        self.margins.append(gap)
        if gap < self.limit:
            self.near_ties += 1
        else:
            self.real.append(f"{request.messages[-1][1][:40]!r}: token {at}, margin {gap:.3f}")

    def line(self) -> str:
        total = self.same + self.near_ties + len(self.real)
        gaps = ", ".join(f"{g:.1e}" for g in self.margins)
        return (f"exactness: {self.same}/{total} token for token, {self.near_ties} near-ties (margin < {self.limit}"
                f"{': ' + gaps if gaps else ''}), {len(self.real)} real differences {self.real}")


def ttft_table(engine: Engine, exact: Exactness, args) -> None:
    system = system_prompt(engine.tokenizer, args.system_tokens)
    cold_t, reused_t, n_prompt, n_reused = [], [], [], []
    for r in range(args.repeats):
        request = GenerateRequest(messages=(("system", system), ("user", QUESTIONS[r % len(QUESTIONS)])),
                                  max_new_tokens=args.max_new_tokens)
        results = {}
        for reuse in ((False, True) if r % 2 == 0 else (True, False)):
            if reuse:
                warm(engine, system)
            results[reuse] = run(engine, reuse, request)
        cold_t.append(results[False].stats.time_to_first_token_s)
        reused_t.append(results[True].stats.time_to_first_token_s)
        n_prompt.append(results[True].prompt_tokens)
        n_reused.append(results[True].stats.prompt_tokens_reused)
        exact.check(request, results[True], results[False])
    cold, reused = statistics.median(cold_t), statistics.median(reused_t)
    print(f"\n| system prompt + question | prompt tokens | reused | TTFT cold | TTFT reused | cold / reused |\n"
          f"|---|---|---|---|---|---|\n"
          f"| {len(engine.tokenizer.encode(system))}-token system prompt | {statistics.median(n_prompt):.0f} | "
          f"{statistics.median(n_reused):.0f} | {cold * 1e3:.0f} ms | {reused * 1e3:.0f} ms | {cold / reused:.1f}x |",
          flush=True)


def dialog_table(engine: Engine, exact: Exactness, args) -> None:
    system = system_prompt(engine.tokenizer, args.dialog_system_tokens, seed=1)
    per_turn = [{"cold": [], "reused": [], "prompt": 0, "kept": 0} for _ in range(args.turns)]
    for r in range(args.repeats):
        history: tuple = (("system", system),)
        warm(engine, system)
        for t in range(args.turns):
            request = GenerateRequest(messages=history + (("user", QUESTIONS[(t + r) % len(QUESTIONS)]),),
                                      max_new_tokens=args.max_new_tokens)
            reused = run(engine, True, request)
            cold = run(engine, False, request)  # leaves its own record: the same tokens when exact
            exact.check(request, reused, cold)
            row = per_turn[t]
            row["cold"].append(cold.stats.time_to_first_token_s)
            row["reused"].append(reused.stats.time_to_first_token_s)
            row["prompt"], row["kept"] = reused.prompt_tokens, reused.stats.prompt_tokens_reused
            history = request.messages + (("assistant", reused.text),)
    print(f"\n{args.turns}-turn dialog ({len(engine.tokenizer.encode(system))}-token system prompt, answers of at most "
          f"{args.max_new_tokens} tokens), medians of {args.repeats}:\n\n"
          f"| turn | prompt tokens | reused | TTFT cold | TTFT reused | cold / reused |\n|---|---|---|---|---|---|")
    for t, row in enumerate(per_turn):
        cold, reused = statistics.median(row["cold"]), statistics.median(row["reused"])
        print(f"| {t + 1} | {row['prompt']} | {row['kept']} | {cold * 1e3:.0f} ms | {reused * 1e3:.0f} ms | "
              f"{cold / reused:.1f}x |", flush=True)


def exactness_grid(engine: Engine, exact: Exactness, args) -> None:
    questions = [p["prompt"] for p in load_prompts(REPO / "bench" / "prompts.jsonl")]
    for s in range(args.systems):
        system = system_prompt(engine.tokenizer, 380 + 29 * s, seed=10 + s)  # other lengths: other chunk bounds
        history: tuple = (("system", system),)
        for t in range(args.exact_turns):
            request = GenerateRequest(messages=history + (("user", questions[(s + t) % len(questions)]),),
                                      max_new_tokens=args.max_new_tokens)
            reused = run(engine, True, request)
            cold = run(engine, False, request)
            exact.check(request, reused, cold)
            history = request.messages + (("assistant", cold.text),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="fp32", help="graphs.weights (fp32 | q4_fp32act | q4 ...)")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--system-tokens", type=int, default=900)
    parser.add_argument("--dialog-system-tokens", type=int, default=380)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--systems", type=int, default=6)
    parser.add_argument("--exact-turns", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--max-context", type=int, default=0, help="graphs.max_context (0: the profile's)")
    parser.add_argument("--skip-timing", action="store_true", help="only the exactness grid")
    args = parser.parse_args()
    settings = {"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": args.weights,
                "speculative.drafter": args.drafter}
    if args.max_context:  # its own profile folder: the default profile's graphs stay as they are
        settings["graphs.max_context"] = args.max_context
        settings["runtime.profile"] = f"{Config().runtime.profile}-ctx{args.max_context}"
    engine = Engine.from_config(Config().replace(**settings), progress=lambda m: print(m, file=sys.stderr))
    print(f"prefix reuse, {args.weights} target, drafter {args.drafter}, max context {engine.target.max_context}")
    exact = Exactness(engine, args.margin)
    if not args.skip_timing:
        ttft_table(engine, exact, args)
        dialog_table(engine, exact, args)
    exactness_grid(engine, exact, args)
    print("\n" + exact.line())


if __name__ == "__main__":
    main()
