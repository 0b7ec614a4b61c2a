"""Tool calls on the 20 robot instructions (bench/robot_instructions.txt) with the robot tools (bench/robot_tools.json:
move_to(place: a room), pick(object), say(text)) and tool_choice required, through the HTTP door (the official
`openai` client's parsed tool_calls, and the streamed deltas assembled), the CLI (`spec-edge generate --tools
--tool-choice required --json`, one process per instruction), the ROS service (`spec-edge serve` on the default
profile, `spec-edge ask --tools ... --json`, one process per instruction), in process with grammar-forced drafts
on and off, and, given --llama-server, llama.cpp's `llama-server` on the same GGUF (LLAMA_ROWS).

    ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=77 PYTHONPATH=$PWD .venv/bin/python bench/tool_calls.py
        [--config config/default.yaml] [--engine-dir engines] [--cli] [--ros] [--llama-server PATH]
        [--llama-threads N] [--out bench/results/tool_calls.json]

Per path: calls that parse (JSON arguments, a known tool) and validate (the tool's schema, llguidance's matcher),
out of 20. In process (same engine, greedy, alone): median latency per answer, tok/s, and the share of each call's
tokens the grammar forced (stats.forced / tokens), forced drafts on vs off. llama.cpp rows (the `openai` client,
tool_choice required, temperature 0, one server each, started with bench/doors.py's llama_server: the same GGUF,
context and threads): the same validity, median latency (the server's own prompt + generation time, and the HTTP
call's wall time), tok/s (its predicted_per_second), interleaved with the in-process rows after a warm-up. Whether
the tool suits the instruction is the 135M model's quality, not the contract (docs/tools.md); the picks are listed
in the JSON output.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOOLS = ROOT / "bench" / "robot_tools.json"
INSTRUCTIONS = ROOT / "bench" / "robot_instructions.txt"
MAX_NEW = 96
# our generic tool rendering for the embedded SmolLM2 as a chat template llama.cpp's --jinja can read
TEMPLATE = ROOT / "bench" / "smollm2_tools.jinja"
# row name -> llama-server arguments. The GGUF's own template has no tool syntax: llama.cpp renders no tools and
# builds no call grammar for it (its auto-parser finds no tool format; docs/bench.md). With our rendering as the
# template it finds Hermes-style <tool_call> JSON blocks, and tool_choice required becomes a grammar over them.
# Prompt lookup: its ngram-simple drafter on the same GGUF, sized like ours (speculative.ngram_min..max 2..4, k 4).
LLAMA_ROWS = {
    "llama.cpp, the GGUF's own template": (),
    "llama.cpp, our rendering as template": ("--chat-template-file", str(TEMPLATE)),
    "llama.cpp, our rendering, prompt lookup": ("--chat-template-file", str(TEMPLATE), "--spec-type", "ngram-simple",
                                                "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4",
                                                "--spec-draft-n-max", "4"),
}


def validator(engine, tools):
    schemas = {t.name: t.parameters for t in tools}

    def valid(name: str, arguments: str) -> bool:
        if name not in schemas:
            return False
        try:
            json.loads(arguments)
        except ValueError:
            return False
        constraint, ids = engine.grammars.constraint("json_schema", schemas[name]), engine.tokenizer.encode(arguments)
        if constraint.admitted(ids) != len(ids):
            return False
        constraint.consume(ids)
        return constraint.complete
    return valid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="profile YAML (default: the default profile)")
    parser.add_argument("--engine-dir", default="engines", help="runtime.engine_dir (default: engines)")
    parser.add_argument("--cli", action="store_true", help="also through `spec-edge generate` (a process each)")
    parser.add_argument("--ros", action="store_true", help="also through the node's service (`spec-edge ask` each)")
    parser.add_argument("--llama-server", type=Path, metavar="PATH",
                        help="llama.cpp's llama-server binary: adds the LLAMA_ROWS (built apart: docs/bench.md)")
    parser.add_argument("--llama-threads", type=int, default=0,
                        help="llama-server's -t/-tb (default 0: runtime.threads, ours, matched)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from spec_edge import artifacts, config as cfgmod
    from spec_edge.http.door import Door
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import Scheduler, run_one
    from spec_edge.runtime.tool_format import tools_from_json
    import openai

    cfg = cfgmod.load(args.config) if args.config else cfgmod.Config()
    cfg = cfg.replace(**{"http.port": 0, "http.api_key": "bench", "runtime.engine_dir": args.engine_dir})
    tools, instructions = tools_from_json(TOOLS.read_text()), INSTRUCTIONS.read_text().splitlines()
    engine = artifacts.engine(cfg, progress=lambda m: None)
    valid = validator(engine, tools)
    report: dict = {"instructions": len(instructions), "profile": cfg.runtime.profile, "weights": cfg.graphs.weights,
                    "drafter": cfg.speculative.drafter, "k": cfg.speculative.k, "load1_before": os.getloadavg()[0]}
    openai_tools = json.loads(TOOLS.read_text())

    def alone(text: str, forced: bool):
        return run_one(engine, GenerateRequest(messages=(("user", text),), tools=tools, tool_choice="required",
                                               max_new_tokens=MAX_NEW, forced_drafts=forced))

    def ours(forced: bool):
        def one(text: str) -> dict:
            r = alone(text, forced)
            return {"ok": bool(r.tool_calls) and all(valid(c.name, c.arguments) for c in r.tool_calls),
                    "s": r.stats.total_time_s, "tok_s": r.stats.tokens_per_s, "tokens": len(r.token_ids),
                    "forced": r.stats.forced, "calls": [(c.name, c.arguments) for c in r.tool_calls]}
        return one

    systems = {"in process, forced drafts on": ours(True), "in process, forced drafts off": ours(False)}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        if args.llama_server:
            from doors import llama_server, stop

            threads = {"runtime.threads": args.llama_threads} if args.llama_threads else {}
            for j, (name, extra) in enumerate(LLAMA_ROWS.items()):
                server, base, version = llama_server(args.llama_server, cfg.replace(**threads), Path(tmp),
                                                     name=f"llama{j}", extra=extra)
                servers.callback(stop, server)
                systems[name] = through_llama(openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600),
                                              openai_tools, valid)
                report[name] = {"server": [str(args.llama_server), *server.args[1:]], "version": version}
        for one in systems.values():  # warm-up, not counted (first-call costs, speculative.k auto's first estimates)
            one(instructions[0])
        rows: dict[str, list] = {name: [] for name in systems}
        for i, text in enumerate(instructions):  # alone, one at a time; interleaved, the order alternating
            for name in (list(systems) if i % 2 == 0 else list(systems)[::-1]):
                rows[name].append(systems[name](text))
    for name, got in rows.items():
        report[name] = report.get(name, {}) | {
            "valid": sum(r["ok"] for r in got), "latency_ms": 1000 * statistics.median(r["s"] for r in got),
            "tok_s": statistics.median(r["tok_s"] for r in got),
            "tokens": statistics.median(r["tokens"] for r in got), "calls": [r["calls"] for r in got]}
        if "forced" in got[0]:
            report[name] |= {"forced_share": sum(r["forced"] for r in got) / sum(r["tokens"] for r in got),
                             "forced_share_per_call": [round(r["forced"] / r["tokens"], 3) for r in got]}
        else:
            report[name] |= {"http_ms": 1000 * statistics.median(r["http_s"] for r in got),
                             "prompt_tokens": statistics.median(r["prompt_tokens"] for r in got),
                             "errors": [r["error"] for r in got if r["error"]],
                             "texts": [r["text"] for r in got if not r["calls"]]}
            if any(r["drafted"] for r in got):
                report[name]["acceptance"] = sum(r["accepted"] for r in got) / sum(r["drafted"] for r in got)
    door = Door(cfg, logging.getLogger("bench")).start()
    scheduler = Scheduler(engine, cfg, logging.getLogger("bench"))
    door.serve(scheduler)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key="bench", max_retries=0)
    ok = same = 0
    walls = []
    for text in instructions:
        ask = dict(model=door.model, messages=[{"role": "user", "content": text}], tools=openai_tools,
                   tool_choice="required", max_tokens=MAX_NEW, temperature=0)
        started = time.perf_counter()
        answer = client.chat.completions.create(**ask)
        walls.append(time.perf_counter() - started)
        calls = [(t.function.name, t.function.arguments) for t in answer.choices[0].message.tool_calls or ()]
        streamed = [(t.function.name, t.function.arguments) for ch in client.chat.completions.create(**ask, stream=True)
                    if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
        ok += bool(calls) and all(valid(*c) for c in calls)
        same += streamed == calls
    report["HTTP door"] = {"valid": ok, "streamed_equal": same, "http_ms": 1000 * statistics.median(walls)}
    scheduler.stop(1.0)
    door.stop()
    if args.cli:
        ok = 0
        for text in instructions:
            argv = [sys.executable, "-m", "spec_edge.cli", "generate", "--prompt", text, "--tools", str(TOOLS),
                    "--tool-choice", "required", "--max-new-tokens", str(MAX_NEW), "--json", "--engine-dir", args.engine_dir]
            argv += ["--config", args.config] if args.config else []
            out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
            calls = json.loads(out.strip().splitlines()[-1]).get("tool_calls", [])
            ok += bool(calls) and all(valid(c["name"], c["arguments"]) for c in calls)
        report["CLI"] = {"valid": ok}
    if args.ros:
        report["ROS service"] = {"valid": through_ros(args, instructions, valid)}
    report["load1_after"] = os.getloadavg()[0]
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def through_llama(client, openai_tools: list[dict], valid):
    """one(text) -> row: a tool_choice required call to a llama-server (greedy; parallel calls allowed, as ours by
    default), timed by the server (prompt + generation ms, its tok/s) and by the client (the HTTP call's wall
    time)."""
    import openai

    def one(text: str) -> dict:
        started = time.perf_counter()
        try:
            answer = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": text}], tools=openai_tools,
                tool_choice="required", parallel_tool_calls=True, max_tokens=MAX_NEW, temperature=0)
        except openai.APIError as err:  # e.g. its parser refusing the output: not a call
            return {"ok": False, "s": time.perf_counter() - started, "http_s": time.perf_counter() - started,
                    "tok_s": 0.0, "tokens": 0, "prompt_tokens": 0, "calls": [], "text": "", "error": str(err)[:300],
                    "drafted": 0, "accepted": 0}
        wall = time.perf_counter() - started
        message, timings = answer.choices[0].message, (answer.model_extra or {}).get("timings", {})
        calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]
        return {"ok": bool(calls) and all(valid(*c) for c in calls), "http_s": wall,
                "s": (timings["prompt_ms"] + timings["predicted_ms"]) / 1000, "tok_s": timings["predicted_per_second"],
                "tokens": answer.usage.completion_tokens, "prompt_tokens": answer.usage.prompt_tokens, "calls": calls,
                "text": message.content or "", "error": "", "drafted": timings.get("draft_n", 0),
                "accepted": timings.get("draft_n_accepted", 0)}
    return one


def through_ros(args, instructions: list[str], valid) -> int:
    """Valid answers of `spec-edge ask --tools ... --tool-choice required --json` to a `spec-edge serve` node (the
    default profile's parameters, runtime.engine_dir set; started and stopped as bench/doors.py does), one ask
    process per instruction."""
    import yaml

    from doors import start_node, stop

    with tempfile.TemporaryDirectory() as tmp:
        doc = yaml.safe_load((ROOT / "config" / "default.yaml").read_text())
        doc["/**"]["ros__parameters"].setdefault("runtime", {})["engine_dir"] = str(Path(args.engine_dir).resolve())
        params = Path(tmp) / "params.yaml"
        params.write_text(yaml.safe_dump(doc))
        node = start_node(params, Path(tmp))[0]
        try:
            ok = 0
            for text in instructions:
                argv = [sys.executable, "-m", "spec_edge.ros2.client", "--prompt", text, "--tools", str(TOOLS),
                        "--tool-choice", "required", "--max-new-tokens", str(MAX_NEW), "--json"]
                out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
                calls = json.loads(out.strip().splitlines()[-1]).get("tool_calls", [])
                ok += bool(calls) and all(valid(c["name"], c["arguments"]) for c in calls)
            return ok
        finally:
            stop(node)


if __name__ == "__main__":
    sys.exit(main())
