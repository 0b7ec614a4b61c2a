"""Serial (today's one-queue node) vs batched (graphs.batch_slots) through the ROS service, plain vs
speculative, 1, 2, 4, 8 client processes, in one run. A measurement, not a timed test.

    ROS_DOMAIN_ID=73 PYTHONPATH=$PWD .venv/bin/python bench/batch_concurrency.py [--clients 1 2 4 8]
        [--slots 8] [--max-new-tokens 48] [--out bench/results/batch_concurrency.json]

Servers (`spec-edge serve`, one at a time, discovery on localhost): serial = config/default.yaml
(drafters none, ngram), serial-hybrid = config/smollm2_hybrid.yaml (drafter hybrid), batched =
config/default.yaml with graphs.batch_slots = --slots (drafters none, ngram; hybrid's EAGLE-3 head has
no per-slot cache yet). For every drafter and N, N client processes (bench/_stream_client.py) each
stream one request (prompts of bench/prompts.jsonl, greedy) starting at the same instant; per N:
total tok/s (all tokens / time until the last answer), per-client tok/s (mean of tokens / own
latency), mean TTFT (first streamed text, queue wait included). The tuned row takes at each N the
better of the batched plain/ngram totals (tools/tune.table_from_totals: k or 0 per load): derived from
the measured rows, not a separate run. The Thor rows are a projection (device/projection.py:
bytes a (B, k+1) call reads = weights once + B slots of static cache), not a measurement.
Writes JSON, a table (.txt) and a plot (.png).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CLIENT = Path(__file__).with_name("_stream_client.py")


def serve(params: Path, log: Path) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(params)], cwd=ROOT,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1800
    while "serving" not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return server


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def burst(prompts: list[str], n: int, fields: dict, max_new: int) -> dict:
    start_at = time.time() + 5 + 1.5 * n  # every process imported rclpy and found the node
    procs = [subprocess.Popen([sys.executable, str(CLIENT), json.dumps(
        {"index": i, "start_at": start_at,
         "request": dict(prompt=prompts[i % len(prompts)], max_new_tokens=max_new, temperature=0.0, **fields)})],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"client failed: {err[-2000:]}")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    bad = [a for a in answers if not a["success"]]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} requests failed: {bad[0]}")
    tokens = [a["num_tokens"] for a in answers]
    makespan = max(a["latency_s"] for a in answers)
    return {"clients": n, "total_tok_s": sum(tokens) / makespan,
            "per_client_tok_s": statistics.mean(a["num_tokens"] / a["latency_s"] for a in answers),
            "ttft_s": statistics.mean(a["ttft_s"] for a in answers), "makespan_s": makespan, "tokens": tokens,
            "texts": [a["text"] for a in answers], "acceptance": [a["stats"]["acceptance_rate"] for a in answers],
            "loadavg": os.getloadavg()[0]}


def thor_projection(model_cfg, clients: list[int], alpha: float, k: int, max_context: int) -> list[dict]:
    """Projected total tok/s on Thor, bf16, batched: a (B, T) call reads the weights once and B static caches."""
    from spec_edge.device import memory, projection

    weights = projection.bytes_read_per_call(model_cfg, "bfloat16", "fp32", max_context) \
        - memory.kv_bytes(model_cfg, max_context, "bfloat16")
    kv = memory.kv_bytes(model_cfg, max_context, "bfloat16")
    rows = []
    for n in clients:
        step = projection.call_seconds(weights + n * kv, model_cfg.n_layers)
        plain = n / step
        spec = n * projection.expected_tokens(alpha, k) / (step * projection.VERIFY_OVERHEAD)
        rows.append({"clients": n, "bytes_per_call": weights + n * kv, "plain_tok_s": plain, "spec_tok_s": spec})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--variants", nargs="+", default=["serial", "serial-hybrid", "batched"])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_concurrency.json"))
    args = parser.parse_args()

    from spec_edge import config as cfgmod
    from spec_edge.graphs import export
    from spec_edge.tools import tune
    from spec_edge.tools.prompts import load_prompts

    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("ROS_DOMAIN_ID", "73")
    prompts = [p["prompt"] for p in load_prompts(kinds=["edit", "free-form"])]
    serve_keys = {"serve.queue_limit": max(args.clients) + 1, "serve.request_timeout_s": 1800.0,
                  "serve.speculate_k_by_load": []}
    default = cfgmod.load(ROOT / "config" / "default.yaml").replace(**serve_keys)
    servers = {"serial": (default, {"plain": {"speculate": False}, "ngram": {"drafter": "ngram"}}),
               "serial-hybrid": (cfgmod.load(ROOT / "config" / "smollm2_hybrid.yaml").replace(**serve_keys),
                                 {"hybrid": {"drafter": "hybrid"}}),
               "batched": (default.replace(**{"graphs.batch_slots": args.slots}),
                           {"plain": {"speculate": False}, "ngram": {"drafter": "ngram"}})}
    tmp = Path(tempfile.mkdtemp(prefix="spec_edge_bconc_"))
    load_start = tune.machine_load()
    results: dict[str, dict[int, dict]] = {}
    for variant in args.variants:
        cfg, drafters = servers[variant]
        params = tmp / f"{variant}.yaml"
        params.write_text(cfgmod.dump(cfg))
        print(f"[bconc] starting {variant} server ...", file=sys.stderr, flush=True)
        server = serve(params, tmp / f"{variant}.log")
        try:
            burst(prompts, 1, {}, 8)  # warm-up
            for name, fields in drafters.items():
                key = f"{'batched' if variant == 'batched' else 'serial'} {name}"
                results[key] = {}
                for n in args.clients:
                    res = burst(prompts, n, fields, args.max_new_tokens)
                    results[key][n] = res
                    print(f"[bconc] {key:16s} N={n}: total {res['total_tok_s']:6.1f} tok/s, per client "
                          f"{res['per_client_tok_s']:6.1f}, TTFT {res['ttft_s']:.2f} s, load {res['loadavg']:.2f}",
                          file=sys.stderr, flush=True)
        finally:
            stop(server)
    report = {"results": {k: {str(n): r for n, r in v.items()} for k, v in results.items()},
              "load_start": load_start, "load_end": tune.machine_load(), "command": " ".join(sys.argv),
              "slots": args.slots, "max_new_tokens": args.max_new_tokens}
    lines = []
    if "batched plain" in results and "batched ngram" in results:
        per_depth = {n: (results["batched plain"][n]["total_tok_s"], results["batched ngram"][n]["total_tok_s"])
                     for n in args.clients}
        k = default.speculative.k
        table = tune.table_from_totals(per_depth, k, max(args.clients))
        tuned = {n: per_depth[n][1] if table[n - 1] else per_depth[n][0] for n in args.clients}
        report.update(tuned_speculate_k_by_load=table, tuned_total_tok_s=tuned)
        lines.append(f"tuned: serve.speculate_k_by_load = {table} (k={k} where ngram was at least as fast as plain; "
                     f"derived from the batched rows)")
    header = f"{'variant':18s}" + "".join(f"{'N=' + str(n):>22s}" for n in args.clients)
    lines += ["total tok/s | per-client tok/s | TTFT s", header]
    for key, rows in results.items():
        lines.append(f"{key:18s}" + "".join(f"{rows[n]['total_tok_s']:8.1f} {rows[n]['per_client_tok_s']:6.1f} "
                                            f"{rows[n]['ttft_s']:5.2f} " for n in args.clients))
    if "tuned_total_tok_s" in report:
        lines.append(f"{'batched tuned':18s}" + "".join(f"{report['tuned_total_tok_s'][n]:8.1f}{'':14s}"
                                                       for n in args.clients))
    for label in ("plain", "ngram"):
        a, b = results.get(f"serial {label}", {}).get(1), results.get(f"batched {label}", {}).get(1)
        if a and b:
            lines.append(f"one client, {label}: batched / serial = {b['total_tok_s'] / a['total_tok_s']:.3f}")
    same = [results[f"batched {label}"][n]["texts"] == results[f"serial {label}"][n]["texts"]
            for label in ("plain", "ngram") for n in args.clients
            if f"batched {label}" in results and f"serial {label}" in results]
    lines.append(f"batched texts == serial texts: {sum(same)}/{len(same)} bursts")
    alpha = statistics.mean(x for r in results.get("batched ngram", results.get("serial ngram", {})).values()
                            for x in r["acceptance"]) if results else 0.0
    model_cfg = export.read_model_config(export.artifact_dir(default, "target"))
    thor = thor_projection(model_cfg, args.clients, alpha, default.speculative.k, default.graphs.max_context)
    report["thor_projection"] = thor
    lines.append(f"PROJECTION (not measured), Thor bf16 {model_cfg.name}, ngram acceptance {alpha:.2f}, "
                 f"k={default.speculative.k}:")
    lines.append("  " + "  ".join(f"N={r['clients']}: plain {r['plain_tok_s']:.0f}, spec {r['spec_tok_s']:.0f} tok/s "
                                  f"({r['bytes_per_call'] / 1e6:.0f} MB/call)" for r in thor))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    plot(results, report, args.clients, out.with_suffix(".png"))
    return 0


def plot(results: dict, report: dict, clients: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for key, rows in results.items():
        style = "-" if key.startswith("batched") else "--"
        for ax, metric in zip(axes[:3], ("total_tok_s", "per_client_tok_s", "ttft_s")):
            ax.plot(clients, [rows[n][metric] for n in clients], style, marker="o", label=key)
    if "tuned_total_tok_s" in report:
        axes[0].plot(clients, [report["tuned_total_tok_s"][n] for n in clients], ":", c="k", lw=2,
                     label="batched tuned (derived)")
    thor = report["thor_projection"]
    axes[3].plot(clients, [r["plain_tok_s"] for r in thor], marker="s", label="plain")
    axes[3].plot(clients, [r["spec_tok_s"] for r in thor], marker="o", label="ngram")
    for ax, title in zip(axes, ("total tok/s (this 2-core CPU)", "tok/s per client", "TTFT s (queue wait incl.)",
                                "PROJECTION: Thor bf16 total tok/s")):
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
