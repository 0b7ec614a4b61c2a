"""A robot shift through the HTTP door: the same few kinds of request all day with new contents, every request asked
once per drafter (none / ngram / suffix, in an order rotated per round and template) of one `spec-edge http`
process, greedy.

    PYTHONPATH=$PWD .venv/bin/python bench/robot_shift.py [--config config/default.yaml] [--rounds 6]
        [--max-new-tokens 96] [--drafters none ngram suffix] [--out bench/results/robot_shift.json]

Templates (3 x --rounds requests, interleaved: status, command, tool, status, ...):
  status   the shift status report of a robot in a fixed line format (copies from the prompt, repeats the format)
  command  an instruction as a JSON action (the same keys every time)
  tool     an instruction as a tool call (bench/robot_tools.json, tool_choice required: the call grammar)
Each drafter sees the shift once (the suffix store holds only what suffix-drafted requests answered). Per drafter:
tokens / second over the shift (completion tokens / wall time of its requests, client side, prefill included) and
decode tokens / second (tokens after the first / time after the first, from the answers' stats); ratios to none and
to ngram per template and over the shift; the answers' token ids must be equal across drafters (greedy).
The 1-minute load average before and after is printed: this machine is shared, only the side-by-side ratios count.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = json.loads((ROOT / "bench" / "robot_tools.json").read_text())
ROBOTS = ["atlas", "bruno", "cleo", "dora", "emil", "fara", "gus", "hana"]
PLACES = ["kitchen", "hall", "bedroom", "garage", "living room", "office"]
TASKS = ["deliver the mail", "clean the floor", "charge the battery", "inspect shelf 4", "carry the red box",
         "water the plants", "patrol the corridor", "restock the cups"]
ERRORS = ["none", "gripper slip", "wheel 2 stalled", "camera dirty", "none", "lidar timeout", "none", "arm overload"]
OBJECTS = ["red cup", "blue box", "green bottle", "yellow towel", "black phone", "white plate", "small bag", "book"]


def status(i: int) -> dict:
    text = (f"Write the status report of robot {ROBOTS[i % 8]}: battery {90 - 7 * i} percent, position "
            f"{PLACES[i % 6]}, task {TASKS[i % 8]}, last error {ERRORS[i % 8]}. Use exactly these lines:\n"
            "Robot: <name>\nBattery: <percent>\nPosition: <place>\nTask: <task>\nError: <error>\n"
            "Next step: <one short sentence>")
    return {"messages": [{"role": "user", "content": text}]}


def command(i: int) -> dict:
    text = (f"Convert this instruction into a JSON action with the keys action, object, location: \"Pick up the "
            f"{OBJECTS[i % 8]} from the {PLACES[(i + 2) % 6]} and bring it to the {PLACES[(i + 4) % 6]}.\" Answer "
            f"with the JSON only.")
    return {"messages": [{"role": "user", "content": text}]}


def tool(i: int) -> dict:
    asks = [f"Go to the {PLACES[i % 6]}.", f"Pick up the {OBJECTS[i % 8]}.", f"Say hello to {ROBOTS[i % 8]}.",
            f"Drive to the {PLACES[(i + 3) % 6]} and wait."]
    return {"messages": [{"role": "user", "content": asks[i % 4]}], "tools": TOOLS, "tool_choice": "required"}


TEMPLATES = {"status": status, "command": command, "tool": tool}


def post(port: int, path: str, body: dict | None = None, timeout: float = 600) -> dict | str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        text = answer.read().decode()
    return json.loads(text) if text.startswith("{") else text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spec_edge.cli", "http", "--port", str(port)]
    if args.config:
        cmd += ["--config", args.config]
    server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"spec-edge http exited: {server.stdout.read()}")
        try:
            post(port, "/health", timeout=5)
            return server
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(2)
    server.kill()
    raise SystemExit("spec-edge http did not answer /health in 900 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="profile YAML (default: the default profile)")
    parser.add_argument("--rounds", type=int, default=6, help="requests per template")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--drafters", nargs="+", default=["none", "ngram", "suffix"])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "robot_shift.json"))
    args = parser.parse_args()
    if args.rounds % len(args.drafters):  # the first of a template's round pays its prompt's prefill (no prefix held)
        parser.error(f"--rounds must be a multiple of the {len(args.drafters)} drafters, so each is first equally "
                     f"often per template (4 rounds of 3: one drafter first twice on the tool calls' long prompt)")
    port = free_port()
    server = start_server(args, port)
    load = [os.getloadavg()[0]]
    rows = []
    try:
        for i in range(args.rounds):
            for t, (name, make) in enumerate(TEMPLATES.items()):
                # rotated per round and template: with 3 templates and 3 drafters a count over requests gave each
                # template one fixed order (tool: suffix always first), the order now cycles every template
                n = (i + t) % len(args.drafters)
                order = args.drafters[n:] + args.drafters[:n]
                for drafter in order:
                    body = {"model": "smollm2-135m", "max_tokens": args.max_new_tokens, "temperature": 0, **make(i)}
                    body |= {"speculate": False} if drafter == "none" else {"drafter": drafter}
                    t0 = time.perf_counter()
                    answer = post(port, "/v1/chat/completions", body)
                    wall = time.perf_counter() - t0
                    ours = answer["spec_edge"]
                    stats = ours["stats"]
                    rows.append({"template": name, "round": i, "drafter": drafter, "wall_s": wall,
                                 "tokens": len(ours["token_ids"]), "token_ids": ours["token_ids"],
                                 "decode_s": stats["total_time_s"] - stats["time_to_first_token_s"],
                                 "accepted": stats["accepted"], "drafted": stats["drafted"]})
                    print(f"[shift] {name} #{i} {drafter:6s} {rows[-1]['tokens']:3d} tokens {wall:6.2f} s "
                          f"acc {stats['accepted']}/{stats['drafted']}", flush=True)
        metrics = post(port, "/metrics")
    finally:
        server.terminate()
        server.wait(30)
    load.append(os.getloadavg()[0])
    return report(rows, args, load, [line for line in metrics.splitlines() if line.startswith("spec_edge_suffix")])


def report(rows: list[dict], args, load: list[float], store_lines: list[str]) -> int:
    def rate(selected: list[dict], what: str) -> float:
        if what == "shift":
            return sum(r["tokens"] for r in selected) / sum(r["wall_s"] for r in selected)
        return sum(max(r["tokens"] - 1, 0) for r in selected) / sum(r["decode_s"] for r in selected)

    answers: dict = {}
    for r in rows:
        answers.setdefault((r["template"], r["round"]), {})[r["drafter"]] = r["token_ids"]
    unequal = [key for key, by in answers.items() if len({tuple(ids) for ids in by.values()}) > 1]
    table = {}
    for scope in [*TEMPLATES, "shift"]:
        picked = [r for r in rows if scope in ("shift", r["template"])]
        for what in ("shift", "decode"):
            rates = {d: rate([r for r in picked if r["drafter"] == d], what) for d in args.drafters}
            table[f"{scope} {what}"] = rates
    print(f"\nrobot shift: {args.rounds} rounds x {len(TEMPLATES)} templates, drafters {args.drafters} rotated, "
          f"greedy, max_tokens {args.max_new_tokens}; load average {load[0]:.1f} -> {load[1]:.1f}")
    head = " ".join(f"{d:>8s}" for d in args.drafters)
    print(f"{'tok/s':16s} {head}  suffix/none  suffix/ngram  ngram/none")
    for key, rates in table.items():
        line = " ".join(f"{rates[d]:8.1f}" for d in args.drafters)
        ratios = ""
        if {"none", "ngram", "suffix"} <= set(rates):
            ratios = (f"  {rates['suffix'] / rates['none']:10.2f}x  {rates['suffix'] / rates['ngram']:11.2f}x  "
                      f"{rates['ngram'] / rates['none']:9.2f}x")
        print(f"{key:16s} {line}{ratios}")
    print(f"answers equal across drafters: {len(answers) - len(unequal)}/{len(answers)}"
          + (f" (differ: {unequal})" if unequal else ""))
    print("\n".join(store_lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"table": table, "load": load, "unequal": unequal, "store": store_lines,
                                          "rows": rows}, indent=1))
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
