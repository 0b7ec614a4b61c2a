"""N robot nodes calling one spec_edge node, through the ROS service: total tok/s, every answer checked
against the same request alone, the node's memory. One or more nodes side by side in one run.

    ROS_DOMAIN_ID=74 PYTHONPATH=$PWD .venv/bin/python bench/concurrency.py [--clients 1 2 4 8]
        [--seconds 60] [--code DIR ...] [--params config/default.yaml config/default.yaml,graphs.batch_slots=4 ...]
        [--node DIR PROFILE ...] [--set graphs.weights=q4 ...] [--drafters profile none ngram]
        [--max-new-tokens 64] [--rounds 1] [--out bench/results/concurrency.json]

Nodes: the --node (checkout, profile) pairs in order, or every --code checkout (default: this one) x every
--params profile (a path relative to that checkout: each serves its own file; PATH,KEY=VALUE,... edits
that profile alone, a list value in brackets: serve.speculate_k_by_load=[4, 4, 0]), started one at a
time as `python -m spec_edge.cli serve` from the checkout (PYTHONPATH = the checkout, this venv, so
the ROS interfaces built into it must match). --set edits every profile; edits go into the YAML as
text (dotted key = YAML value), so an older checkout reads it with its own config code;
serve.queue_limit is raised to max(--clients) + 1 where lower.

Drafters: `profile` sends no drafter field (the profile's own drafter and policy), `none` sends
speculate=false, any other name drafter=<name>. Per node and drafter, after a warm-up burst, N client
processes (bench/_stream_client.py, the action, streamed; prompts of bench/prompts.jsonl, greedy)
start at one instant, in one of two modes:

- bursts (default): --rounds bursts per N > 1, each client sending ONE request, burst r on the prompts
  from r * N on; the N=1 row is the solo runs below. The burst's tail (the longest answer) is charged.
- closed loop (--seconds S): per round a window per N, N alternating within the round (1, 4, 1, 4, ...),
  N=1 included; client j sends prompts j, j+N, j+2N, ... (mod the prompt count) back to back, each as
  soon as its last answer arrives, until S seconds have passed since the start (the request in
  flight finished): the usual serving benchmark ("concurrency N").

Then solo: every prompt that was used, alone (one client, one request after another): the reference.
Per N: total tok/s (all tokens / time from the start to the window's or burst's last answer, summed
over them), tok/s per client (tokens / own latency, queue wait included), TTFT, and how many answers
equal the same prompt's solo answer token for token (exactness at any occupancy: a difference fails
the run, exit code 1), per window the 1-minute load average after it and the cores (CPU s / s) the
node, the client processes and the rest of the machine used from the start to its last answer; each
answer (window, prompt index, tokens, latency, TTFT, k, acceptance, prompt rows reused, text) is
kept in the JSON. Per node: VmRSS and Pss (/proc/<pid>/smaps_rollup, the node process) after each
window, the largest kept; ratios of each node's N=1 total to the first node's, and of its N-client
total to its own N=1 total. Writes JSON, a table (.txt) and a plot (.png); with `none` and one speculative
drafter, the first node's totals per number of clients also as `rows` (plain vs speculative).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CLIENT = Path(__file__).with_name("_stream_client.py")


def profile_text(path: Path, settings: list[str], clients: int) -> str:
    """The profile's YAML with --set applied (dotted keys, YAML values) and queue_limit >= clients + 1."""
    doc = yaml.safe_load(path.read_text()) or {}
    body = doc["/**"]["ros__parameters"] if "/**" in doc else doc
    for setting in settings:
        key, _, value = setting.partition("=")
        section, name = key.split(".", 1)
        body.setdefault(section, {})[name] = yaml.safe_load(value)
    serve = body.setdefault("serve", {})
    serve["queue_limit"] = max(int(serve.get("queue_limit", 0)), clients + 1)
    return yaml.safe_dump(doc, sort_keys=False)


def split_profile(spec: str) -> list[str]:
    """PATH,KEY=VALUE,... -> [PATH, KEY=VALUE, ...]; a comma inside [...] belongs to a list value."""
    return re.split(r",(?![^\[]*\])", spec)


def serve(code: Path, params: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(code))
    server = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(params)], cwd=code,
                              env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1800  # a fresh checkout exports its graphs first
    while "serving" not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"{code}: the node did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return server


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and Pss of a process, MB."""
    out = {}
    for name, key in (("status", "VmRSS:"), ("smaps_rollup", "Pss:")):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key):
                out[key.rstrip(":").lower() + "_mb"] = int(line.split()[1]) / 1024
                break
    return out


def fields_for(drafter: str) -> dict:
    return {} if drafter == "profile" else {"speculate": False} if drafter == "none" else {"drafter": drafter}


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by a process (user + system) and by the whole machine (all but idle/iowait)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    machine = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (int(fields[11]) + int(fields[12])) / tick, (sum(machine) - machine[3] - machine[4]) / tick


def clients(prompts: list[str], queues: list[list[int]], fields: dict, max_new: int, node: int,
            seconds: float | None = None) -> tuple[list[dict], dict]:
    """One client process per queue of prompt indices, all starting at one instant, each sending its
    prompts back to back (once, or cycling until `seconds` after the start): every answer, in client order,
    and the cores used from the start to the last answer by the node (pid), the clients and the rest."""
    start_at = time.time() + 5 + 1.5 * len(queues)  # every process imported rclpy and found the node
    procs = [subprocess.Popen([sys.executable, str(CLIENT), json.dumps(
        {"index": j, "start_at": start_at, "seconds": seconds, "prompts": [[i, prompts[i]] for i in queue],
         "request": dict(max_new_tokens=max_new, temperature=0.0, **fields)})],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j, queue in enumerate(queues)]
    time.sleep(max(0.0, start_at - time.time()))
    node_cpu, machine_cpu = cpu_seconds(node)
    answers = []
    for j, proc in enumerate(procs):
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"client failed: {err[-2000:]}")
        answers += [dict(json.loads(line), client=j) for line in out.splitlines() if line.startswith("{")]
    bad = [a for a in answers if not a["success"]]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(answers)} requests failed: {bad[0]}")
    wall = time.time() - start_at
    node_used, machine_used = (b - a for a, b in zip((node_cpu, machine_cpu), cpu_seconds(node)))
    client_used = sum(max(a["cpu_s"] for a in answers if a["client"] == j) for j in range(len(queues)))
    return answers, {"node": node_used / wall, "clients": client_used / wall,
                     "rest": (machine_used - node_used - client_used) / wall}


def row(n: int, windows: list[list[dict]], loads: list[dict], solo: dict[int, dict]) -> dict:
    """Per N: windows (or bursts) of answers that started at one instant; each one's time runs from its first
    request's start to its last answer."""
    every = [a for answers in windows for a in answers]
    makespan = sum(max(a["done_s"] for a in answers) - min(a["start_s"] for a in answers) for answers in windows)
    equal = sum(a["text"] == solo[a["prompt"]]["text"] for a in every)
    return {"clients": n, "windows": len(windows), "total_tok_s": sum(a["num_tokens"] for a in every) / makespan,
            "per_client_tok_s": statistics.mean(a["num_tokens"] / a["latency_s"] for a in every),
            "ttft_s": statistics.mean(a["ttft_s"] for a in every), "makespan_s": makespan,
            "equal_to_solo": equal, "answers": len(every), "load": loads,
            "each": [{"window": w, "prompt": a["prompt"], "tokens": a["num_tokens"],
                      "latency_s": round(a["latency_s"], 3), "ttft_s": round(a["ttft_s"], 3),
                      "done_s": round(a["done_s"], 3), "k": a["stats"]["k"],
                      "acceptance": a["stats"]["acceptance_rate"], "reused": a["stats"]["prompt_tokens_reused"],
                      "text": a["text"]} for w, answers in enumerate(windows) for a in answers]}


def load_text(load: list[dict]) -> str:
    """Each window's load average and cores used (node / clients / rest of the machine)."""
    return ", ".join(f"{w['loadavg']:.2f} ({w['cores']['node']:.2f}/{w['cores']['clients']:.2f}/"
                     f"{w['cores']['rest']:.2f})" for w in load)


def run_node(code: Path, params: Path, drafters: list[str], counts: list[int], prompts: list[str], args,
             tmp: Path, label: str) -> dict:
    server = serve(code, params, tmp / f"{label.replace('/', '_')}.log")
    memory = {"vmrss_mb": 0.0, "pss_mb": 0.0}
    rows: dict[str, dict[int, dict]] = {}

    def sample() -> None:
        for key, value in memory_mb(server.pid).items():
            memory[key] = max(memory[key], value)
    try:
        for drafter in drafters:
            fields = fields_for(drafter)
            clients(prompts, [[i % len(prompts)] for i in range(max(counts))], fields, 16, server.pid)  # warm-up
            windows: dict[int, list[list[dict]]] = {n: [] for n in counts}
            loads: dict[int, list[dict]] = {n: [] for n in counts}
            for r in range(args.rounds):  # closed loop: N alternating within a round; bursts: N > 1 only
                for n in counts if args.seconds else counts[1:]:
                    queues = ([[(j + m * n) % len(prompts) for m in range(len(prompts))] for j in range(n)]
                              if args.seconds else [[(r * n + j) % len(prompts)] for j in range(n)])
                    answers, cores = clients(prompts, queues, fields, args.max_new_tokens, server.pid, args.seconds)
                    windows[n].append(answers)
                    loads[n].append(dict(loadavg=os.getloadavg()[0], cores=cores))
                    sample()
            used = sorted({a["prompt"] for w in windows.values() for answers in w for a in answers}
                          | (set() if args.seconds else set(range(min(args.rounds, len(prompts))))))
            answers, cores = clients(prompts, [used], fields, args.max_new_tokens, server.pid)  # one by one
            solo = {a["prompt"]: a for a in answers}
            if not args.seconds:  # bursts: the solo runs are the N=1 row
                windows[1], loads[1] = [[solo[i]] for i in used], [dict(loadavg=os.getloadavg()[0], cores=cores)]
            sample()
            rows[drafter] = {n: row(n, windows[n], loads[n], solo) for n in counts}
            for n, r in sorted(rows[drafter].items()):
                print(f"[concurrency] {label} {drafter:8s} N={n}: total {r['total_tok_s']:6.1f} tok/s, per client "
                      f"{r['per_client_tok_s']:6.1f}, TTFT {r['ttft_s']:.2f} s, equal to solo {r['equal_to_solo']}/"
                      f"{r['answers']}, load {load_text(r['load'])}", file=sys.stderr, flush=True)
    finally:
        stop(server)
    return {"code": str(code), "params": str(params), "memory": memory, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--code", nargs="+", default=[str(ROOT)], help="checkouts to run the node from, in order")
    parser.add_argument("--params", nargs="+", default=["config/default.yaml"],
                        help="profiles, each relative to every --code checkout; PATH,KEY=VALUE,... edits that one")
    parser.add_argument("--node", nargs=2, action="append", default=[], metavar=("DIR", "PROFILE"),
                        help="one node: a checkout and its profile (PATH[,KEY=VALUE...]); repeatable, in order; "
                             "replaces the --code x --params nodes")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="edits of every profile, e.g. graphs.batch_slots=4")
    parser.add_argument("--drafters", nargs="+", default=["profile"],
                        help="profile (no drafter field), none (speculate=false) or a drafter name")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float,
                        help="closed loop: each client sends its next request as soon as its last answer arrives, "
                             "for this many seconds per window (default: bursts, one request per client)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="bursts per N > 1, each on the next prompts; with --seconds: windows per N")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "concurrency.json"))
    args = parser.parse_args()
    if sorted(set(args.clients)) != args.clients or args.clients[0] != 1:
        parser.error("--clients: increasing, starting at 1 (the N=1 row)")
    if args.seconds is not None and args.seconds <= 0:
        parser.error("--seconds: a window of more than 0 s (leave it out for bursts)")
    pairs = [(checkout, spec) for checkout in args.code for spec in args.params] if not args.node else args.node
    edits = args.set + [e for _, profile in pairs for e in split_profile(profile)[1:]]
    if any("=" not in e or "." not in e.partition("=")[0] for e in edits):
        parser.error("--set and PATH,... take section.key=value")

    from spec_edge.tools.bench import machine_load
    from spec_edge.tools.prompts import load_prompts

    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(100, 200)))
    prompts = [p["prompt"] for p in load_prompts()]
    tmp = Path(tempfile.mkdtemp(prefix="spec_edge_concurrency_"))
    load_start = machine_load()
    nodes = []
    for i, (checkout, spec) in enumerate(pairs):
        code = Path(checkout).resolve()
        profile, *own = split_profile(spec)
        params = tmp / f"node{i}.yaml"
        params.write_text(profile_text(code / profile, args.set + own, max(args.clients)))
        label = f"{code.name}:{Path(profile).stem}" + "".join(f",{e}" for e in own)
        print(f"[concurrency] starting {label} (ROS_DOMAIN_ID {os.environ['ROS_DOMAIN_ID']}) ...", file=sys.stderr,
              flush=True)
        nodes.append(dict(run_node(code, params, args.drafters, args.clients, prompts, args, tmp, label), label=label))
    mode = (f"closed loop, {args.rounds} window(s) of {args.seconds:g} s per N" if args.seconds else
            f"bursts, {args.rounds} per N > 1")
    lines = [f"total tok/s | per-client tok/s | TTFT s | answers equal to solo; {mode}; {args.max_new_tokens} new "
             f"tokens, greedy, load {load_start['loadavg_1m']} -> {machine_load()['loadavg_1m']}",
             f"{'node':28s} {'drafter':8s}" + "".join(f"{'N=' + str(n):>30s}" for n in args.clients)]
    for node in nodes:
        for drafter, rows in node["rows"].items():
            lines.append(f"{node['label']:28s} {drafter:8s}" + "".join(
                f"{rows[n]['total_tok_s']:8.1f} {rows[n]['per_client_tok_s']:6.1f} {rows[n]['ttft_s']:5.2f} "
                f"{rows[n]['equal_to_solo']:4d}/{rows[n]['answers']:<4d}" for n in args.clients))
    first = nodes[0]
    for node in nodes:
        memory = node["memory"]
        lines.append(f"{node['label']}: VmRSS {memory['vmrss_mb']:.0f} MB, Pss {memory['pss_mb']:.0f} MB")
        for drafter, rows in node["rows"].items():
            solo = rows[1]["total_tok_s"]
            ratios = ", ".join(f"{n} clients {rows[n]['total_tok_s'] / solo:.2f}x" for n in args.clients if n > 1)
            base = first["rows"][drafter][1]["total_tok_s"]
            lines.append(f"  {drafter}: 1 client {solo / base:.3f}x of {first['label']}; of its own 1 client: {ratios}")
            lines.append(f"  {drafter}: per window load average (cores: node/clients/rest) " + "; ".join(
                f"N={n} {load_text(rows[n]['load'])}" for n in args.clients))
    text = "\n".join(lines)
    print(text)
    report = {"nodes": nodes, "clients": args.clients, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "seconds": args.seconds,
              "load_start": load_start, "load_end": machine_load(), "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    spec = [d for d in first["rows"] if d != "none"]
    if "none" in first["rows"] and len(spec) == 1:  # plain vs speculative per number of clients
        plain, fast = first["rows"]["none"], first["rows"][spec[0]]
        report["k"] = max(a["k"] for n in args.clients for a in fast[n]["each"])
        report["rows"] = [{"clients": n, "plain_total_tok_s": plain[n]["total_tok_s"],
                           "spec_total_tok_s": fast[n]["total_tok_s"]} for n in args.clients]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    plot(nodes, args.clients, out.with_suffix(".png"))
    print(f"[concurrency] wrote {out} (.txt, .png)", file=sys.stderr)
    unequal = sum(r["answers"] - r["equal_to_solo"] for node in nodes for rows in node["rows"].values()
                  for r in rows.values())
    if unequal:
        print(f"[concurrency] {unequal} answers differ from the same request alone", file=sys.stderr)
    return 1 if unequal else 0


def plot(nodes: list[dict], clients: list[int], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[concurrency] matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for node in nodes:
        for drafter, rows in node["rows"].items():
            for ax, metric in zip(axes, ("total_tok_s", "per_client_tok_s", "ttft_s")):
                ax.plot(clients, [rows[n][metric] for n in clients], marker="o", label=f"{node['label']} {drafter}")
    for ax, title in zip(axes, ("total tok/s", "tok/s per client (queue wait incl.)", "TTFT s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels(clients)
        ax.set_xlabel("client processes")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
