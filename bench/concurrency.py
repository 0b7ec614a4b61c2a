"""Concurrency trade-off through the ROS service: 1, 2, 4, 8 clients at once, with and without speculation.

    .venv/bin/python bench/concurrency.py [--clients 1 2 4 8] [--rounds 2] [--max-new-tokens 64]
                                          [--params config/default.yaml] [--out bench/results/concurrency.json]

Starts `spec-edge serve` (its own ROS_DOMAIN_ID, discovery on localhost), then for every number of
clients N and every round sends N service calls at once, once with speculate=true and once with
speculate=false (order alternating by round), and records per request the wall latency (queue wait
included) and the tokens it got. Per N it reports: total tokens/s (all tokens / time until the last
answer), tokens/s per client (tokens / own latency, mean) and the engine's own decode tok/s; then the
per-load table (k where speculation paid, else 0) that `spec-edge tune --concurrency-json` writes into
serve.speculate_k_by_load. Writes JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--params", default=str(ROOT / "config" / "default.yaml"))
    parser.add_argument("--kinds", nargs="+", default=["edit", "free-form"], help="prompt kinds the clients cycle through")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "concurrency.json"))
    parser.add_argument("--domain-id", type=int, default=random.randint(100, 200))
    args = parser.parse_args()

    from spec_edge import config as cfgmod
    from spec_edge.tools import tune
    from spec_edge.tools.prompts import load_prompts

    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ["ROS_DOMAIN_ID"] = str(args.domain_id)
    cfg = cfgmod.load(args.params)
    cfg = cfg.replace(**{"serve.queue_limit": max(cfg.serve.queue_limit, max(args.clients) + 1),
                         "serve.request_timeout_s": 600.0, "serve.speculate_k_by_load": []})
    prompts = load_prompts(kinds=args.kinds, quick=False)
    tmp = Path(tempfile.mkdtemp(prefix="spec_edge_conc_"))
    params = tmp / "serve.yaml"
    params.write_text(cfgmod.dump(cfg))
    load_start = tune.machine_load()
    print(f"[concurrency] load {load_start}; drafter {cfg.speculative.drafter} k={cfg.speculative.k}; "
          f"clients {args.clients}; ROS_DOMAIN_ID {args.domain_id}", file=sys.stderr)
    server = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(params)],
                              cwd=ROOT, stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    import rclpy

    from spec_edge.ros2.client import GenerateClient, fill_request
    from spec_edge.ros2.messages import response_to_dict

    rclpy.init(args=[])
    client = GenerateClient(node_name="spec_edge_concurrency")
    rows = []
    raw = []
    try:
        client.wait(300.0)
        # warm-up (first request loads lazily-built state)
        client.call(timeout=300, prompt=prompts[0]["prompt"], max_new_tokens=8)

        def burst(n: int, speculate: bool) -> dict:
            requests = [dict(prompt=prompts[i % len(prompts)]["prompt"], max_new_tokens=args.max_new_tokens,
                             temperature=0.0, speculate=speculate) for i in range(n)]
            started = time.monotonic()
            futures = [client.service.call_async(fill_request(client.srv_type.Request(), **r)) for r in requests]
            done_at = [None] * n
            while not all(done_at) and time.monotonic() - started < 900:
                rclpy.spin_once(client.node, timeout_sec=0.02)
                for i, f in enumerate(futures):
                    if done_at[i] is None and f.done():
                        done_at[i] = time.monotonic() - started
            answers = [response_to_dict(f.result()) for f in futures]
            bad = [a["message"] for a in answers if not a["success"]]
            if bad:
                raise RuntimeError(f"requests failed: {bad[:2]}")
            tokens = [a["num_tokens"] for a in answers]
            return {"clients": n, "speculate": speculate, "makespan_s": max(done_at), "latency_s": done_at,
                    "tokens": tokens, "engine_tok_s": [a["stats"]["tokens_per_s"] for a in answers],
                    "total_tok_s": sum(tokens) / max(done_at),
                    "per_client_tok_s": statistics.mean(t / l for t, l in zip(tokens, done_at)),
                    "loadavg": os.getloadavg()[0]}

        for n in args.clients:
            results = {True: [], False: []}
            for r in range(args.rounds):
                for speculate in ((True, False) if r % 2 == 0 else (False, True)):
                    res = burst(n, speculate)
                    raw.append(res)
                    results[speculate].append(res)
                    print(f"[concurrency] N={n} speculate={speculate} total {res['total_tok_s']:.1f} tok/s, per client "
                          f"{res['per_client_tok_s']:.1f}, load {res['loadavg']:.2f}", file=sys.stderr)
            med = lambda rs, key: statistics.median(x[key] for x in rs)  # noqa: E731
            rows.append({"clients": n,
                         "plain_total_tok_s": med(results[False], "total_tok_s"),
                         "spec_total_tok_s": med(results[True], "total_tok_s"),
                         "plain_per_client_tok_s": med(results[False], "per_client_tok_s"),
                         "spec_per_client_tok_s": med(results[True], "per_client_tok_s"),
                         "plain_engine_tok_s": statistics.median(x for r in results[False] for x in r["engine_tok_s"]),
                         "spec_engine_tok_s": statistics.median(x for r in results[True] for x in r["engine_tok_s"])})
    finally:
        client.close()
        rclpy.try_shutdown()
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    per_depth = {row["clients"]: (row["plain_total_tok_s"], row["spec_total_tok_s"]) for row in rows}
    table = tune.table_from_totals(per_depth, cfg.speculative.k, max(per_depth))
    report = {"rows": rows, "raw": raw, "speculate_k_by_load": table, "load_start": load_start,
              "load_end": tune.machine_load(), "drafter": cfg.speculative.drafter, "k": cfg.speculative.k,
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "command": " ".join(sys.argv)}
    print(f"{'clients':>7s} {'plain total':>11s} {'spec total':>10s} {'plain/client':>12s} {'spec/client':>11s} "
          f"{'plain engine':>12s} {'spec engine':>11s}")
    for row in rows:
        print(f"{row['clients']:7d} {row['plain_total_tok_s']:11.1f} {row['spec_total_tok_s']:10.1f} "
              f"{row['plain_per_client_tok_s']:12.1f} {row['spec_per_client_tok_s']:11.1f} "
              f"{row['plain_engine_tok_s']:12.1f} {row['spec_engine_tok_s']:11.1f}")
    print(f"speculate_k_by_load = {table} (k where speculation paid at that many clients, else 0)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["clients"] for r in rows]
        for ax, key, title in ((axes[0], "total_tok_s", "total tokens/s"), (axes[1], "per_client_tok_s",
                                                                             "tokens/s per client (queue wait included)")):
            ax.plot(xs, [r[f"spec_{key}"] for r in rows], marker="o", label="speculation")
            ax.plot(xs, [r[f"plain_{key}"] for r in rows], marker="s", label="plain")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels(xs)
            ax.set_xlabel("concurrent clients")
            ax.set_title(title, fontsize=10)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
        print(f"[concurrency] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    except ImportError:
        print(f"[concurrency] wrote {out} (no matplotlib: no plot)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
