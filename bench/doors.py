"""One node through each of its doors, side by side in one run: in process (a Scheduler over the engine, no door),
the ROS door (the action, streamed: bench/_stream_client.py processes), the HTTP door (the official `openai` client,
streamed, one thread per client) of the same node process, and, given --llama-server, llama.cpp's own OpenAI server
(its `llama-server` binary, built apart: docs/bench.md) on the same GGUF with the same HTTP clients.

    ROS_DOMAIN_ID=74 PYTHONPATH=$PWD .venv/bin/python bench/doors.py [--params config/default.yaml]
        [--clients 1 4] [--prompts 4] [--max-new-tokens 64] [--rounds 3] [--llama-server PATH]
        [--out bench/results/doors.json]

Per system and N clients: N clients start at one instant, each streaming the prompts i, i+N, ... of the first
--prompts quick prompts of bench/prompts.jsonl (greedy) one after another. TTFT (median, first text), decode tok/s
per request (median; tokens after the first over the time after the first), total tok/s (all tokens / wall time of
the row), the answers equal to the in-process answer of the same prompt alone, the 1-minute load average after the
row. The in-process engine and the node are loaded together (idle while the other serves); rows run one at a time,
interleaved over --rounds (every system at every N per round), and the table gives their medians.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CLIENT = Path(__file__).with_name("_stream_client.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def summary(name: str, n: int, answers: list[dict], wall: float, reference: dict[int, str]) -> dict:
    tokens = sum(a["tokens"] for a in answers)
    return {"system": name, "clients": n, "requests": len(answers), "tokens": tokens,
            "ttft_ms": 1000 * statistics.median(a["ttft_s"] for a in answers),
            "decode_tok_s": statistics.median(a["decode_tok_s"] for a in answers),
            "total_tok_s": tokens / wall, "equal": sum(reference.get(a["prompt"]) == a["text"] for a in answers),
            "load1": os.getloadavg()[0]}


def timed(prompt: int, started: float, first: float | None, text: str, tokens: int) -> dict:
    done = time.perf_counter()
    first = first or done
    return {"prompt": prompt, "text": text, "tokens": tokens, "ttft_s": first - started,
            "decode_tok_s": (tokens - 1) / (done - first) if tokens > 1 and done > first else 0.0}


def at_once(n: int, prompts: list[str], one) -> tuple[list[dict], float]:
    """n threads, thread j running one(i) for i = j, j+n, ...; (answers, wall seconds)."""
    answers: list[dict] = []

    def client(j: int) -> None:
        for i in range(j, len(prompts), n):
            answers.append(one(i))

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - started


def in_process(cfg, prompts: list[str], max_new: int):
    """(run(n) -> (answers, wall), stop()) over a Scheduler in this process."""
    import logging

    from spec_edge import artifacts
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import Job, Scheduler

    engine = artifacts.engine(cfg, progress=lambda m: None)
    scheduler = Scheduler(engine, cfg, logging.getLogger("bench"))

    def one(i: int) -> dict:
        first: list[float] = []
        job = Job(GenerateRequest(messages=(("user", prompts[i]),), max_new_tokens=max_new),
                  on_text=lambda delta, n: first or first.append(time.perf_counter()))
        started = time.perf_counter()
        scheduler.submit(job)
        job.done.wait()
        return timed(i, started, first[0] if first else None, job.outcome.text, job.outcome.num_tokens)

    def stop_here() -> None:
        scheduler.stop(1.0)
        engine.close()

    at_once(1, prompts, one)  # warm-up
    return (lambda n: at_once(n, prompts, one)), stop_here


def http_system(base: str, model: str, key: str, prompts: list[str], max_new: int):
    """run(n) -> (answers, wall) through an OpenAI-compatible server (the `openai` client, streamed)."""
    import openai

    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)

    def one(i: int) -> dict:
        started, first, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=max_new, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        return timed(i, started, first, text, usage.completion_tokens if usage else 0)

    at_once(1, prompts[:1], one)  # warm-up
    return lambda n: at_once(n, prompts, one)


def ros_system(prompts: list[str], max_new: int):
    """run(n) -> (answers, wall) through the ROS door: n client processes (the action, streamed) from one instant."""
    def run(n: int) -> tuple[list[dict], float]:
        start_at = time.time() + 6
        procs = [subprocess.Popen([sys.executable, str(CLIENT), json.dumps(
            {"index": j, "start_at": start_at, "seconds": None, "request": {"max_new_tokens": max_new},
             "prompts": [[i, prompts[i]] for i in range(j, len(prompts), n)]})], stdout=subprocess.PIPE, text=True)
            for j in range(n)]
        lines = [json.loads(line) for p in procs for line in p.communicate()[0].splitlines() if line.startswith("{")]
        answers = [{"prompt": a["prompt"], "text": a["text"], "tokens": a["num_tokens"], "ttft_s": a["ttft_s"],
                    "decode_tok_s": (a["num_tokens"] - 1) / (a["latency_s"] - a["ttft_s"])
                    if a["num_tokens"] > 1 else 0.0} for a in lines]
        return answers, max(a["done_s"] for a in lines)
    return run


def start_node(params: Path, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """The node (`spec-edge serve`) on params with its HTTP door on a free port: (process, base URL, model)."""
    doc = yaml.safe_load(params.read_text())
    port = free_port()
    doc["/**"]["ros__parameters"]["http"] = {"enabled": True, "port": port, "api_key": "bench"}
    (tmp / "node.yaml").write_text(yaml.safe_dump(doc))
    server = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(tmp / "node.yaml")],
                              cwd=ROOT, stdout=(tmp / "node.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    deadline = time.monotonic() + 600
    while "serving" not in (tmp / "node.log").read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the node did not start:\n{(tmp / 'node.log').read_text()}")
        time.sleep(0.5)
    profile = doc["/**"]["ros__parameters"].get("runtime", {}).get("profile", "smollm2-135m")
    return server, f"http://127.0.0.1:{port}/v1", profile


def llama_server(binary: Path, cfg, tmp: Path, *, name: str = "llama", slots: int = 1,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    """llama.cpp's own OpenAI server (the `llama-server` binary at `binary`, model alias `smollm2`) on loopback at a
    free port, matched to cfg: its GGUF (model.target), graphs.max_context tokens of KV per slot (`-c` that times
    slots, `-np slots`), runtime.threads (0: one per core, as ONNX Runtime's pool) for decode and prompt (`-t`, `-tb`);
    `--jinja` (its chat templates and tool calls), plus extra arguments; its log in tmp/<name>.log. (process, base
    URL, `binary --version`'s version line). Exits with the log's tail when it does not answer /health within 5 min."""
    import httpx

    from spec_edge.graphs.weights import resolve

    gguf, ctx, threads = resolve(cfg.model.target), cfg.graphs.max_context, cfg.runtime.threads or os.cpu_count() or 1
    port = free_port()
    log = tmp / f"{name}.log"
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    version = next((line for line in (version.stdout + version.stderr).splitlines() if line.startswith("version")),
                   "version unknown")
    server = subprocess.Popen([str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--jinja",
                               "--ctx-size", str(ctx * slots), "--parallel", str(slots), "--threads", str(threads),
                               "--threads-batch", str(threads), "--alias", "smollm2", "--no-webui", *extra],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while server.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server, f"http://127.0.0.1:{port}/v1", version
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(server)
    raise SystemExit(f"llama-server did not start ({' '.join(server.args)}):\n{log.read_text()[-2000:]}")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(30)


def main() -> int:
    from spec_edge import config as cfgmod

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(ROOT / "config" / "default.yaml"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every system at every N)")
    parser.add_argument("--llama-server", type=Path, metavar="PATH",
                        help="llama.cpp's llama-server binary: adds its row (the same GGUF, context and threads)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    params = Path(args.params)
    cfg = cfgmod.load(params)
    lines = [json.loads(line) for line in (ROOT / "bench" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [p["prompt"] for p in lines if p.get("quick")][:args.prompts]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_here, stop_here = in_process(cfg, prompts, args.max_new_tokens)
        reference = {a["prompt"]: a["text"] for a in run_here(1)[0]}
        node, base, model = start_node(params, Path(tmp))
        llama, note = None, "llama.cpp server skipped: no --llama-server"
        if args.llama_server:
            llama, llama_base, version = llama_server(args.llama_server, cfg, Path(tmp), slots=max(args.clients))
            note = f"llama.cpp server: {args.llama_server} {version}, Q4_1 (the GGUF's own weights)"
        try:
            systems = {"in process": run_here,
                       "HTTP door": http_system(base, model, "bench", prompts, args.max_new_tokens),
                       "ROS door": ros_system(prompts, args.max_new_tokens)}
            if llama is not None:
                systems["llama.cpp server"] = http_system(llama_base, "smollm2", "none", prompts, args.max_new_tokens)
            for r in range(args.rounds):  # interleaved: the machine's drift falls on every system alike
                for n in args.clients:
                    for name, run in systems.items():
                        rows.append(summary(name, n, *run(n), reference) | {"round": r})
        finally:
            stop_here()
            stop(node)
            if llama is not None:
                stop(llama)
    print(f"medians over {args.rounds} interleaved rounds; answers equal to the in-process answer alone")
    print(f"{'system':18} {'N':>2} {'req':>4} {'TTFT ms':>8} {'decode tok/s':>12} {'total tok/s':>11} "
          f"{'equal':>8} {'load1':>6}")
    for n in args.clients:
        for name in systems:
            mine = [r for r in rows if r["system"] == name and r["clients"] == n]
            med = {key: statistics.median(r[key] for r in mine)
                   for key in ("ttft_ms", "decode_tok_s", "total_tok_s", "load1")}
            equal, requests = sum(r["equal"] for r in mine), sum(r["requests"] for r in mine)
            print(f"{name:18} {n:>2} {requests:>4} {med['ttft_ms']:>8.0f} {med['decode_tok_s']:>12.1f} "
                  f"{med['total_tok_s']:>11.1f} {equal:>4}/{requests:<3} {med['load1']:>6.2f}")
    if note:
        print(note)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "note": note, "prompts": prompts}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
