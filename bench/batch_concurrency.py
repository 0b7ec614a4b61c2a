"""Serial (today's one-queue node) vs batched (graphs.batch_slots) through the ROS service, plain vs
speculative, 1, 2, 4, 8 client processes, in one run. A measurement, not a timed test.

    ROS_DOMAIN_ID=73 PYTHONPATH=$PWD .venv/bin/python bench/batch_concurrency.py [--clients 1 2 4 8]
        [--slots 8] [--max-new-tokens 48] [--rounds 1] [--solo-rounds 4] [--k-values 2 4] [--tuned bench/results/tuned_k_by_load_b8.yaml]
        [--variants serial serial-hybrid batched batched-tuned batched-hybrid]
        [--out bench/results/batch_concurrency.json]

Servers (`spec-edge serve`, one at a time, discovery on localhost): serial = config/default.yaml
(drafters none, ngram), serial-hybrid = config/smollm2_hybrid.yaml (drafter hybrid), batched =
config/default.yaml with graphs.batch_slots = --slots (drafters none, ngram), batched-tuned = the
batched server with serve.speculate_k_by_load read from --tuned (the table `spec-edge tune` wrote for
these slots; requests ask for ngram, the node steps k down with the occupancy), batched-hybrid =
smollm2_hybrid.yaml with the slots and graphs.k_values = its k alone (profile folder <profile>-k<k>; each
slot its own n-gram + EAGLE-3 head state). Every server but
the hybrid ones gets graphs.k_values = --k-values, so they share one exported folder. For every drafter
and N, after a warm-up burst, N client processes (bench/_stream_client.py) each stream one request (the
prompts of bench/prompts.jsonl, the ones `spec-edge tune` measures acceptance on; greedy) starting at the
same instant (--rounds bursts per N, one client --solo-rounds, each on the next prompts); per N: total tok/s (all tokens / time until
the last answer), per-client tok/s (mean of tokens / own latency), mean TTFT (first streamed text,
queue wait included). The Thor rows are a projection (device/projection.py: bytes a (B, k+1) call reads
= weights once + B slots of static cache), not a measurement. Writes JSON, a table (.txt) and a plot (.png).
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


def burst(prompts: list[str], n: int, fields: dict, max_new: int, offset: int = 0) -> dict:
    start_at = time.time() + 5 + 1.5 * n  # every process imported rclpy and found the node
    procs = [subprocess.Popen([sys.executable, str(CLIENT), json.dumps(
        {"index": i, "start_at": start_at,
         "request": dict(prompt=prompts[(offset + i) % len(prompts)], max_new_tokens=max_new, temperature=0.0,
                         **fields)})],
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
    return {"tokens": [a["num_tokens"] for a in answers], "latencies_s": [a["latency_s"] for a in answers],
            "ttfts_s": [a["ttft_s"] for a in answers], "texts": [a["text"] for a in answers],
            "acceptance": [a["stats"]["acceptance_rate"] for a in answers],
            "makespan_s": max(a["latency_s"] for a in answers), "loadavg": os.getloadavg()[0]}


def measure(prompts: list[str], n: int, fields: dict, max_new: int, rounds: int) -> dict:
    """`rounds` bursts of n clients, round r on the prompts from r * n on: total tok/s = all tokens / the
    bursts' summed makespans (time until each burst's last answer), per-client tok/s (tokens / own
    latency) and TTFT the means over every request."""
    runs = [burst(prompts, n, fields, max_new, offset=r * n) for r in range(rounds)]
    every = {key: [x for run in runs for x in run[key]] for key in ("tokens", "latencies_s", "ttfts_s", "texts",
                                                                  "acceptance")}
    makespan = sum(run["makespan_s"] for run in runs)
    return {"clients": n, "rounds": rounds, "total_tok_s": sum(every["tokens"]) / makespan,
            "per_client_tok_s": statistics.mean(t / s for t, s in zip(every["tokens"], every["latencies_s"])),
            "ttft_s": statistics.mean(every["ttfts_s"]), "makespan_s": makespan, **every,
            "loadavg": statistics.mean(run["loadavg"] for run in runs)}


THOR_PROFILE = ROOT / "config" / "thor_llama31_8b_batch4.yaml"


def thor_projection(cfg, clients: list[int], alpha: float, k: int) -> list[dict]:
    """Projected total tok/s on Thor for cfg's model, graphs.dtype / weights, max_context: a call over n slots
    reads the weights once and the n slots' static caches whole (device/projection.py's bytes and constants)."""
    from spec_edge.device import memory, profiles, projection

    g = cfg.graphs
    model = profiles.model_config(cfg.model.target)
    quant = g.weights if g.weights in memory.QUANTIZATIONS else "fp32"  # what TensorRT Edge-LLM builds
    kv = memory.kv_bytes(model, g.max_context)
    weights = projection.bytes_read_per_call(model, quant, g.max_context) - kv
    rows = []
    for n in clients:
        step = projection.call_seconds(weights + n * kv, model.n_layers)
        rows.append({"model": model.name, "dtype": g.dtype, "weights": quant, "max_context": g.max_context,
                     "clients": n, "bytes_per_call": weights + n * kv, "plain_tok_s": n / step,
                     "spec_tok_s": n * projection.expected_tokens(alpha, k) / (step * projection.VERIFY_OVERHEAD)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--variants", nargs="+", default=["serial", "serial-hybrid", "batched", "batched-tuned"],
                        choices=["serial", "serial-hybrid", "batched", "batched-tuned", "batched-hybrid"])
    parser.add_argument("--k-values", type=int, nargs="+", default=[2, 4],
                        help="graphs.k_values of the non-hybrid servers (one exported folder for all of them)")
    parser.add_argument("--tuned", default=str(ROOT / "bench" / "results" / "tuned_k_by_load_b8.yaml"),
                        help="profile written by `spec-edge tune` for these slots: its serve.speculate_k_by_load")
    parser.add_argument("--rounds", type=int, default=1, help="bursts per N > 1, each on the next prompts")
    parser.add_argument("--solo-rounds", type=int, default=4,
                        help="bursts of one client per variant, each on the next prompt (the single-client ratio)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_concurrency.json"))
    args = parser.parse_args()

    from spec_edge import config as cfgmod
    from spec_edge.device import projection
    from spec_edge.tools import tune
    from spec_edge.tools.prompts import load_prompts

    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("ROS_DOMAIN_ID", "73")
    prompts = [p["prompt"] for p in load_prompts()]  # the prompts `spec-edge tune` measures acceptance on
    serve_keys = {"serve.queue_limit": max(args.clients) + 1, "serve.request_timeout_s": 1800.0,
                  "serve.speculate_k_by_load": []}
    default = cfgmod.load(ROOT / "config" / "default.yaml").replace(
        **serve_keys, **{"graphs.k_values": tuple(args.k_values)})
    hybrid = cfgmod.load(ROOT / "config" / "smollm2_hybrid.yaml").replace(**serve_keys)
    batched = default.replace(**{"graphs.batch_slots": args.slots})
    ngram = {"ngram": {"drafter": "ngram"}}
    servers = {"serial": (default, {"plain": {"speculate": False}, **ngram}),
               "serial-hybrid": (hybrid, {"hybrid": {"drafter": "hybrid"}}),
               "batched": (batched, {"plain": {"speculate": False}, **ngram}),
               # only the hybrid's own k: a verify width is one graph per row count, each holding the weights
               "batched-hybrid": (hybrid.replace(**{"graphs.batch_slots": args.slots,
                                                    "graphs.k_values": (hybrid.speculative.k,),
                                                    "runtime.profile": f"{hybrid.runtime.profile}-k{hybrid.speculative.k}"}),
                                  {"hybrid": {"drafter": "hybrid"}})}
    if "batched-tuned" in args.variants:
        table = cfgmod.load(args.tuned).serve.speculate_k_by_load
        if len(table) != args.slots or any(k and k not in args.k_values for k in table):
            raise SystemExit(f"--tuned {args.tuned}: serve.speculate_k_by_load {list(table)} is not a table for "
                             f"{args.slots} slots with k in --k-values {args.k_values}; run `spec-edge tune` "
                             f"with graphs.batch_slots: {args.slots} first")
        servers["batched-tuned"] = (batched.replace(**{"serve.speculate_k_by_load": table,
                                                       "speculative.k": max(table) or default.speculative.k}),
                                    {"tuned": {"drafter": "ngram"}})
    tmp = Path(tempfile.mkdtemp(prefix="spec_edge_bconc_"))
    load_start = tune.machine_load()
    results: dict[str, dict[int, dict]] = {}
    partial = Path(args.out).with_suffix(".partial.json")
    for variant in args.variants:
        cfg, drafters = servers[variant]
        params = tmp / f"{variant}.yaml"
        params.write_text(cfgmod.dump(cfg))
        print(f"[bconc] starting {variant} server ...", file=sys.stderr, flush=True)
        server = serve(params, tmp / f"{variant}.log")
        try:
            for name, fields in drafters.items():
                key = f"{variant.split('-')[0]} {name}"
                results[key] = {}
                burst(prompts, max(args.clients), fields, 16)  # warm-up: the first runs of each call shape
                for n in args.clients:
                    res = measure(prompts, n, fields, args.max_new_tokens, args.solo_rounds if n == 1 else args.rounds)
                    results[key][n] = res
                    print(f"[bconc] {key:16s} N={n}: total {res['total_tok_s']:6.1f} tok/s, per client "
                          f"{res['per_client_tok_s']:6.1f}, TTFT {res['ttft_s']:.2f} s, load {res['loadavg']:.2f}",
                          file=sys.stderr, flush=True)
        finally:
            stop(server)
        partial.write_text(json.dumps(results, indent=1))  # what has run so far, should a later server fail
    report = {"results": {k: {str(n): r for n, r in v.items()} for k, v in results.items()},
              "load_start": load_start, "load_end": tune.machine_load(), "command": " ".join(sys.argv),
              "slots": args.slots, "max_new_tokens": args.max_new_tokens}
    lines = []
    if "batched tuned" in results:
        report["tuned_speculate_k_by_load"] = list(servers["batched-tuned"][0].serve.speculate_k_by_load)
        lines.append(f"batched tuned: serve.speculate_k_by_load = {report['tuned_speculate_k_by_load']} "
                     f"(from {args.tuned}), requests ask for ngram")
    header = f"{'variant':18s}" + "".join(f"{'N=' + str(n):>22s}" for n in args.clients)
    lines += ["total tok/s | per-client tok/s | TTFT s", header]
    for key, rows in results.items():
        lines.append(f"{key:18s}" + "".join(f"{rows[n]['total_tok_s']:8.1f} {rows[n]['per_client_tok_s']:6.1f} "
                                            f"{rows[n]['ttft_s']:5.2f} " for n in args.clients))
    for label in ("plain", "ngram", "hybrid"):
        a, b = results.get(f"serial {label}", {}).get(1), results.get(f"batched {label}", {}).get(1)
        if a and b:
            lines.append(f"one client, {label}: batched / serial = {b['total_tok_s'] / a['total_tok_s']:.3f}")
    if all(key in results for key in ("batched tuned", "batched plain", "batched ngram")):
        ratios = {n: results["batched tuned"][n]["total_tok_s"] / max(results["batched plain"][n]["total_tok_s"],
                                                                     results["batched ngram"][n]["total_tok_s"])
                  for n in args.clients}
        report["tuned_over_better"] = ratios
        lines.append("batched tuned / the better of batched plain and ngram: "
                     + ", ".join(f"N={n}: {r:.3f}" for n, r in ratios.items()))
    same = [results[f"{kind} {label}"][n]["texts"] == results[f"serial {ref}"][n]["texts"]
            for kind, label, ref in (("batched", "plain", "plain"), ("batched", "ngram", "ngram"),
                                     ("batched", "tuned", "plain"), ("batched", "hybrid", "hybrid"))
            for n in args.clients if f"{kind} {label}" in results and f"serial {ref}" in results]
    lines.append(f"batched texts == serial texts (greedy): {sum(same)}/{len(same)} bursts")
    report["texts_equal"] = [sum(same), len(same)]
    alpha = statistics.mean(x for r in results.get("batched ngram", results.get("serial ngram", {})).values()
                            for x in r["acceptance"]) if results else 0.0
    thor_cfg = cfgmod.load(THOR_PROFILE)
    projections = {"this bench's model": thor_projection(default.replace(**{"runtime.backend": "tensorrt", "graphs.dtype": "float16",
                                                                             "speculative.drafter": "none"}),
                                                         args.clients, alpha, default.speculative.k),
                   THOR_PROFILE.name: thor_projection(thor_cfg, args.clients, alpha, thor_cfg.speculative.k)}
    report["thor_projection"] = projections
    for label, rows in projections.items():
        r0 = rows[0]
        lines.append(f"PROJECTION (not measured): Thor, {r0['model']} {r0['dtype']} weights {r0['weights']}, "
                     f"S={r0['max_context']} per slot ({label}), ngram acceptance {alpha:.2f} i.i.d., "
                     f"verify = {projection.VERIFY_OVERHEAD:.2f} step:")
        lines.append("  " + "  ".join(f"N={r['clients']}: plain {r['plain_tok_s']:.0f}, spec {r['spec_tok_s']:.0f} "
                                      f"tok/s ({r['bytes_per_call'] / 1e9:.2f} GB/call)" for r in rows))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    plot(results, report, args.clients, out.with_suffix(".png"))
    partial.unlink(missing_ok=True)
    return 0


def plot(results: dict, report: dict, clients: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for key, rows in results.items():
        style = ":" if key == "batched tuned" else "-" if key.startswith("batched") else "--"
        for ax, metric in zip(axes[:3], ("total_tok_s", "per_client_tok_s", "ttft_s")):
            ax.plot(clients, [rows[n][metric] for n in clients], style, marker="o", label=key)
    for (label, rows), marker in zip(report["thor_projection"].items(), "so"):
        axes[3].plot(clients, [r["plain_tok_s"] for r in rows], marker=marker, label=f"{rows[0]['model']} plain")
        axes[3].plot(clients, [r["spec_tok_s"] for r in rows], "--", marker=marker, label=f"{rows[0]['model']} ngram")
    axes[3].set_yscale("log")  # the 135M and the 8B model, two orders of magnitude apart
    for ax, title in zip(axes, ("total tok/s (this 2-core CPU)", "tok/s per client", "TTFT s (queue wait incl.)",
                                "PROJECTION: Thor total tok/s")):
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
