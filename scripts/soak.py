"""Soak the ROS 2 node: N client processes over loopback for a given time against one node.

    ROS_DOMAIN_ID=64 .venv/bin/python scripts/soak.py [--duration 600] [--clients 8] [--params FILE]

Starts the node (`spec-edge serve --params FILE`, default config/default.yaml with
serve.request_timeout_s=--request-timeout), then N client processes that each, until the duration
is over, send a random mix: short greedy requests (a fixed set of prompts: every answer to one must be
the same text), long sampled requests, guided JSON requests, action goals cancelled after a random
number of feedbacks, requests that run past the timeout, and bad requests. Every --burst-every seconds
the clients pause after their current request and a burst of exactly slots + serve.queue_limit service
calls is sent at once (the node's documented capacity: each must be served, none answered busy). Every
request is counted as answered, refused (a bad request), busy, cancelled, timed out, failed (the engine
reported an error) or lost (no answer within request_timeout + 60 s: there must be none). 8 clients hold at
most 8 requests and a burst runs while they pause, so the node is never past its capacity: any busy answer
is a fault. Prints the counts, whether the
repeated greedy answers were identical, p50/p99 time to first token (client side: goal sent ->
first feedback, queue wait included; and the node's stats.time_to_first_token_s), the node's memory at
start and end by kind (VmRSS, Pss, private anonymous, file-backed: docs/ros.md "Which memory to watch") and
the private anonymous memory from minute 2 (or half the duration) to the end, as lines and one JSON object
(--json FILE). Exit status 1 on a lost, failed or busy request, a burst answer that was not served, or
differing greedy answers. docs/ros.md has the figures of a 10-minute run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS = REPO / "config" / "default.yaml"  # the default profile (= spec_edge/config.py's defaults)
sys.path.insert(0, str(REPO))  # this checkout's spec_edge, as the node and the client processes get (PYTHONPATH)
GREEDY = [("Name three tools a robot arm can hold.", 24), ("Which way is the kitchen?", 16),
          ("Say hello to the visitor.", 12), ("List two colours of the rainbow.", 16)]
LONG = "Write a long story about a robot that learns to paint, with many details about colours."
SCHEMA = json.dumps({"type": "object", "properties": {"room": {"type": "string", "maxLength": 12},
                                                      "floor": {"type": "integer"}},
                     "required": ["room", "floor"]})
BAD = [{"prompt": ""}, {"prompt": "hi", "top_p": 2.0}, {"messages": [["robot", "hi"]]},
       {"prompt": "hi", "max_new_tokens": 100000}, {"prompt": "hi", "drafter": "telepathy"}]
KINDS = ("greedy", "long", "guided", "cancel", "timeout", "bad")
COUNTS = ("sent", "answered", "refused", "busy", "cancelled", "timed_out", "failed", "lost")
BURST_REQUEST = {"prompt": "Say hello to the visitor.", "max_new_tokens": 8, "temperature": 0.0}
WEIGHTS = (6, 2, 2, 3, 1, 3)


STEADY_S = 120.0  # private memory is compared from here (after warm-up: every kind of request has run) to the end


def memory_mb(pid: int) -> dict[str, float]:
    """The node's memory by kind in MB (spec_edge/ros2/memory.py breakdown(): rss, pss, anon, file)."""
    from spec_edge.ros2.memory import breakdown
    return {kind: round(value / 1e6, 1) for kind, value in breakdown(pid).items()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None  # JSON has no NaN
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------------------------------
# One client process


def request_for(kind: str, rng: random.Random) -> dict:
    if kind == "greedy":
        prompt, n = rng.choice(GREEDY)
        return {"prompt": prompt, "max_new_tokens": n, "temperature": 0.0}
    if kind == "long":
        return {"prompt": LONG, "max_new_tokens": rng.choice([64, 128]), "temperature": 0.7, "top_p": 0.9}
    if kind == "guided":
        return {"prompt": "Where is the robot? Answer in JSON.", "max_new_tokens": 48,
                "guided": {"json_schema": SCHEMA}}
    if kind == "cancel":
        return {"prompt": LONG, "max_new_tokens": 200}
    if kind == "timeout":
        return {"prompt": LONG, "max_new_tokens": 900, "temperature": 0.0}
    return dict(rng.choice(BAD))


def classify(answer) -> str:
    if answer.success:
        return "cancelled" if answer.finish_reason == "cancelled" else "answered"
    if answer.finish_reason == "":
        return "busy" if answer.message.startswith("busy") else "refused"
    if answer.finish_reason == "cancelled":
        return "cancelled"
    return "timed_out" if answer.message.startswith("timed out") else "failed"


def client_main(index: int, deadline: float, patience: float, out_path: str) -> None:
    """One client: requests of the mix until the deadline; while <out dir>/pause exists (a burst), it waits
    between requests and says so with <out dir>/paused<index>."""
    import rclpy

    from spec_edge.ros2.client import GenerateClient
    rng = random.Random(index)
    counts = {k: 0 for k in COUNTS}
    greedy: dict[str, list[str]] = {}
    ttft_client: list[float] = []
    ttft_server: list[float] = []
    problems: list[str] = []
    rclpy.init(args=[])
    client = GenerateClient(node_name=f"soak_client_{index}")
    client.wait(120.0)
    pause, paused = Path(out_path).parent / "pause", Path(out_path).parent / f"paused{index}"
    while time.time() < deadline:
        while pause.exists() and time.time() < deadline:
            paused.touch()
            time.sleep(0.2)
        if time.time() >= deadline:  # released by the deadline, not by the burst's end: send nothing more
            break
        paused.unlink(missing_ok=True)
        kind = rng.choices(KINDS, WEIGHTS)[0]
        fields = request_for(kind, rng)
        if "guided" in fields:
            from spec_edge_interfaces.msg import Guided
            fields["guided"] = Guided(**fields["guided"])
        counts["sent"] += 1
        try:
            if kind in ("cancel", "long"):
                sent = time.monotonic()
                cancel_after = rng.randint(1, 12) if kind == "cancel" else None
                seen = []

                def on_feedback(fb, seen=seen, sent=sent, cancel_after=cancel_after):
                    if not seen:
                        ttft_client.append(time.monotonic() - sent)
                    seen.append(fb.delta)
                    return cancel_after is not None and len(seen) >= cancel_after

                answer, _status = client.stream(on_feedback, timeout=patience, **fields)
            else:
                answer = client.call(timeout=patience, **fields)
        except TimeoutError as err:
            counts["lost"] += 1
            problems.append(f"{kind}: {err}")
            continue
        outcome = classify(answer)
        counts[outcome] += 1
        if kind == "bad" and outcome != "refused":
            problems.append(f"bad request {fields} was not refused: {outcome} {answer.message}")
        if outcome == "failed":
            problems.append(f"{kind}: {answer.message}")
        if outcome == "answered" and answer.stats.time_to_first_token_s > 0:
            ttft_server.append(answer.stats.time_to_first_token_s)
        if kind == "greedy" and outcome == "answered":
            greedy.setdefault(f"{fields['prompt']}|{fields['max_new_tokens']}", []).append(answer.text)
    client.close()
    rclpy.try_shutdown()
    Path(out_path).write_text(json.dumps({"counts": counts, "greedy": greedy, "ttft_client": ttft_client,
                                          "ttft_server": ttft_server, "problems": problems}))


def burster_main(size: int, folder: str) -> None:
    """The burst process: on each <folder>/go<n>, `size` service calls at once; their outcomes to done<n>."""
    import rclpy

    from spec_edge.ros2.client import GenerateClient, fill_request
    rclpy.init(args=[])
    client = GenerateClient(node_name="soak_burster")
    client.wait(120.0)
    (Path(folder) / "burster_ready").touch()
    n = 0
    while not (Path(folder) / "stop").exists():
        if not (Path(folder) / f"go{n}").exists():
            time.sleep(0.1)
            continue
        futures = [client.service.call_async(fill_request(client.srv_type.Request(), **BURST_REQUEST))
                   for _ in range(size)]
        limit = time.monotonic() + 300.0
        while not all(f.done() for f in futures) and time.monotonic() < limit:
            rclpy.spin_once(client.node, timeout_sec=0.1)
        outcomes = [classify(f.result()) if f.done() else "lost" for f in futures]
        (Path(folder) / f"done{n}").write_text(json.dumps(outcomes))
        n += 1
    client.close()
    rclpy.try_shutdown()


def burst(tmp: Path, n: int, clients: int, patience: float) -> list[str]:
    """Pause the clients (each after its current request), send burst n, resume; the burst's outcomes."""
    pause = tmp / "pause"
    pause.touch()
    try:
        limit = time.time() + patience
        while time.time() < limit and sum((tmp / f"paused{i}").exists() or (tmp / f"client{i}.json").exists()
                                          for i in range(clients)) < clients:
            time.sleep(0.2)
        time.sleep(1.0)  # a cancelled goal leaves the node's queue
        (tmp / f"go{n}").touch()
        while not (tmp / f"done{n}").exists() and time.time() < limit + 300.0:
            time.sleep(0.2)
        return json.loads((tmp / f"done{n}").read_text()) if (tmp / f"done{n}").exists() else ["lost"]
    finally:
        pause.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The run


def soak(duration: float, clients: int, params: str, request_timeout: float, log_path: Path,
         burst_every: float) -> dict:
    import yaml

    from spec_edge.config import load
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    tmp = Path(tempfile.mkdtemp(prefix="spec_edge_soak_"))
    tree = yaml.safe_load(Path(params).read_text())
    tree["/**"]["ros__parameters"].setdefault("serve", {})["request_timeout_s"] = float(request_timeout)
    node_params = tmp / "params.yaml"
    node_params.write_text(yaml.safe_dump(tree))
    cfg = load(node_params)
    capacity = cfg.graphs.batch_slots + cfg.serve.queue_limit  # what the node holds before it answers busy
    log = log_path.open("w")
    node = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(node_params)],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while "serving" not in log_path.read_text(errors="replace"):
            if node.poll() is not None:
                raise SystemExit(f"the node exited with {node.returncode}:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        burster = subprocess.Popen([sys.executable, __file__, "--burst-size", str(capacity), "--out", str(tmp)],
                                   env=env, cwd=REPO)
        ready_by = time.time() + 120.0
        while not (tmp / "burster_ready").exists():
            if burster.poll() is not None or time.time() > ready_by:
                raise SystemExit("the burst client did not reach the node (exit status "
                                 f"{burster.poll()}); see {log_path}")
            time.sleep(0.2)
        memory_start = memory_mb(node.pid)
        started = time.time()
        deadline = started + duration
        patience = request_timeout + 60.0
        outs = [tmp / f"client{i}.json" for i in range(clients)]
        procs = [subprocess.Popen([sys.executable, __file__, "--client", str(i), "--deadline", str(deadline),
                                   "--patience", str(patience), "--out", str(out)], env=env, cwd=REPO)
                 for i, out in enumerate(outs)]
        steady = []  # (s since start, private anonymous MB) every 10 s from min(STEADY_S, duration / 2) on
        bursts: list[list[str]] = []
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
            since = time.time() - started
            if burst_every > 0 and since >= burst_every * (len(bursts) + 1) and time.time() < deadline - 10:
                bursts.append(burst(tmp, len(bursts), clients, patience))
            if since >= min(STEADY_S, duration / 2) and (not steady or since - steady[-1][0] >= 10.0):
                steady.append((round(since), memory_mb(node.pid).get("anon", 0.0)))
        codes = [p.wait() for p in procs]
        memory_end = memory_mb(node.pid)
        (tmp / "stop").touch()
        burster.wait(60)
    finally:
        (tmp / "stop").touch()
        node.send_signal(signal.SIGTERM)
        node.wait(30)
        log.close()
    results = [json.loads(out.read_text()) if out.exists() else None for out in outs]
    counts = {k: 0 for k in COUNTS}
    greedy: dict[str, set[str]] = {}
    ttft_client, ttft_server, problems = [], [], []
    for i, (code, result) in enumerate(zip(codes, results)):
        if result is None:
            problems.append(f"client {i} exited with {code} without a result")
            continue
        for k, v in result["counts"].items():
            counts[k] += v
        for key, texts in result["greedy"].items():
            greedy.setdefault(key, set()).update(texts)
        ttft_client += result["ttft_client"]
        ttft_server += result["ttft_server"]
        problems += [f"client {i}: {p}" for p in result["problems"]]
    return {"duration_s": duration, "clients": clients, "params": params, "request_timeout_s": request_timeout,
            "counts": counts, "capacity": capacity,
            "bursts": {"n": len(bursts), "size": capacity,
                       "served": sum(o.count("answered") for o in bursts), "not_served": [
                           f"burst {i}: {o.count('answered')} of {len(o)} served ({sorted(set(o))})"
                           for i, o in enumerate(bursts) if o.count("answered") != len(o)]},
            "greedy_identical": all(len(t) == 1 for t in greedy.values()),
            "greedy_prompts_answered": {k: len(t) for k, t in greedy.items()},
            "ttft_client_s": {"p50": percentile(ttft_client, 0.5), "p99": percentile(ttft_client, 0.99),
                              "n": len(ttft_client)},
            "ttft_server_s": {"p50": percentile(ttft_server, 0.5), "p99": percentile(ttft_server, 0.99),
                              "n": len(ttft_server)},
            "memory_mb": {"start": memory_start, "end": memory_end},
            "anon_steady_mb": {"from_s": steady[0][0] if steady else None,
                               "first": steady[0][1] if steady else None,
                               "min": min(m for _, m in steady) if steady else None,
                               "max": max(m for _, m in steady) if steady else None,
                               "end": memory_end.get("anon")},
            "node_exit": node.returncode, "problems": problems[:20], "clients_ok": all(c == 0 for c in codes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="the node's profile (default: the default profile)")
    parser.add_argument("--request-timeout", type=float, default=20.0,
                        help="serve.request_timeout_s of the node (the 900-token requests run past it)")
    parser.add_argument("--burst-every", type=float, default=120.0,
                        help="seconds between bursts of slots + serve.queue_limit calls (0: none)")
    parser.add_argument("--log", default="soak_node.log", help="the node's log")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--patience", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--burst-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.burst_size is not None:
        burster_main(args.burst_size, args.out)
        return 0
    if args.client is not None:
        client_main(args.client, args.deadline, args.patience, args.out)
        return 0
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    summary = soak(args.duration, args.clients, args.params, args.request_timeout, Path(args.log), args.burst_every)
    c = summary["counts"]
    print(f"requests sent {c['sent']}: answered {c['answered']}, refused (bad) {c['refused']}, busy {c['busy']}, cancelled "
          f"{c['cancelled']}, timed out {c['timed_out']}, failed {c['failed']}, lost {c['lost']}")
    print(f"repeated greedy answers identical: {summary['greedy_identical']} "
          f"({sum(summary['greedy_prompts_answered'].values())} distinct texts over {len(GREEDY)} prompts)")
    for side in ("client", "server"):
        t = summary[f"ttft_{side}_s"]
        if t["n"]:
            print(f"time to first token ({side}): p50 {t['p50']:.3f} s, p99 {t['p99']:.3f} s over {t['n']}")
    for when in ("start", "end"):
        m = summary["memory_mb"][when]
        print(f"node memory at {when}: VmRSS {m.get('rss')} MB, Pss {m.get('pss')} MB, private anonymous "
              f"{m.get('anon')} MB, file-backed {m.get('file')} MB")
    a = summary["anon_steady_mb"]
    if a["first"]:
        print(f"private anonymous memory from {a['from_s']} s to the end: {a['first']} MB -> {a['end']} MB "
              f"({100 * (a['end'] / a['first'] - 1):+.1f} %; range {a['min']}-{a['max']} MB)")
    b = summary["bursts"]
    print(f"bursts of {b['size']} (slots + queue_limit) to a paused load: {b['n']}, served {b['served']} of "
          f"{b['n'] * b['size']}" + "".join(f"; {line}" for line in b["not_served"]))
    for problem in summary["problems"]:
        print("problem:", problem)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(json.dumps(summary, allow_nan=False))
    ok = (c["lost"] == 0 and c["failed"] == 0 and c["busy"] == 0 and not summary["bursts"]["not_served"]
          and summary["greedy_identical"] and summary["clients_ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
