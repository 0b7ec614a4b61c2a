"""What `spec-edge bench` makes of its runs: the summary rows and mismatches (JSON), the table on
stdout with its verdict, and the PNG.

summarize takes medians over repeats and ratios within a round, and compares every greedy run with
its family's plain run and with spec_edge's fp32 target-only run (a mismatch gets the first differing
token and the fp32 target's top-2 logit margin there).
"""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np

from spec_edge.tools.systems import INEXACT_VARIANTS


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _margin(engine, prompt_ids: list[int], plain_ids: list[int], at: int) -> float | None:
    """fp32 target's top-2 logit margin for the token at index `at` of the plain greedy output."""
    try:
        logits = engine.target.prefill(prompt_ids + plain_ids[:at], 0)
        top2 = np.sort(logits)[-2:]
        return float(top2[1] - top2[0])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def summarize(systems, runs, prompts, prompt_ids, engines, costs, temperatures) -> dict:
    by = defaultdict(list)
    for r in runs:
        by[(r.system, r.prompt_id, r.temperature, r.repeat)].append(r)
    index = {key: rs[0] for key, rs in by.items()}
    spec_fp32_plain = next((s.name for s in systems if s.family == "spec_edge" and s.drafter == "none"
                            and s.weights == "fp32"), None)
    rows = []
    mismatches_spec, mismatches_peer = [], []
    for s in systems:
        for temp in temperatures:
            mine = [r for r in runs if r.system == s.name and r.temperature == temp]
            if not mine:
                continue
            ratio_own, ratio_spec = [], []
            per_kind = defaultdict(list)
            equal_own = equal_spec = compared_own = compared_spec = 0
            for r in mine:
                base = index.get((s.plain, r.prompt_id, temp, r.repeat))
                if base and base.tokens_per_s > 0:
                    ratio_own.append(r.tokens_per_s / base.tokens_per_s)
                    per_kind[r.kind].append(r.tokens_per_s / base.tokens_per_s)
                sbase = index.get((spec_fp32_plain, r.prompt_id, temp, r.repeat)) if spec_fp32_plain else None
                if sbase and sbase.tokens_per_s > 0:
                    ratio_spec.append(r.tokens_per_s / sbase.tokens_per_s)
                if temp != 0.0:
                    continue
                if base is not None and s.name != s.plain:
                    compared_own += 1
                    at = _first_diff(r.token_ids, base.token_ids)
                    if at is None:
                        equal_own += 1
                    else:
                        entry = {"system": s.name, "prompt": r.prompt_id, "repeat": r.repeat, "first_diff": at,
                                 "vs": s.plain, "weights": s.weights}
                        engine = engines.get("fp32")
                        if engine is not None:
                            entry["fp32_top2_margin"] = _margin(engine, prompt_ids[r.prompt_id], base.token_ids, at)
                        (mismatches_spec if s.family == "spec_edge" else mismatches_peer).append(entry)
                if sbase is not None and s.family != "spec_edge":
                    compared_spec += 1
                    at = _first_diff(r.token_ids, sbase.token_ids)
                    if at is None:
                        equal_spec += 1
                    else:
                        entry = {"system": s.name, "prompt": r.prompt_id, "repeat": r.repeat, "first_diff": at,
                                 "vs": spec_fp32_plain}
                        engine = engines.get("fp32")
                        if engine is not None:
                            entry["fp32_top2_margin"] = _margin(engine, prompt_ids[r.prompt_id], sbase.token_ids, at)
                        mismatches_peer.append(entry)

            def med(values):
                values = [v for v in values if v is not None]
                return statistics.median(values) if values else None

            # median over repeats per prompt, then over prompts
            per_prompt_tps = defaultdict(list)
            for r in mine:
                per_prompt_tps[r.prompt_id].append(r.tokens_per_s)
            tps = med([med(v) for v in per_prompt_tps.values()])
            drafted = sum(r.drafted for r in mine)
            accepted = sum(r.accepted for r in mine)
            verifies = sum(r.verify_calls for r in mine)
            calls = verifies + sum(r.step_calls for r in mine)
            decoded = sum(max(len(r.token_ids) - 1, 0) for r in mine)  # the first token comes from the prefill
            rows.append({
                "system": s.name, "family": s.family, "weights": s.weights, "drafter": s.drafter, "k": s.k,
                "temperature": temp, "runs": len(mine), "tokens_per_s": tps,
                "ttft_ms": 1000 * med([r.ttft_s for r in mine]),
                "acceptance": accepted / drafted if drafted else None,
                "mean_accepted_length": (accepted + verifies) / verifies if verifies else None,
                "verify_share": verifies / max(1, calls) if s.family == "spec_edge" else None,
                "tokens_per_target_call": decoded / calls if calls and s.family == "spec_edge" else None,
                "draft_ms_per_token": (1000 * sum(r.draft_s for r in mine) / decoded
                                       if decoded and s.family == "spec_edge" and s.drafter != "none" else None),
                "ratio_to_own_plain": med(ratio_own), "ratio_to_spec_edge_fp32_plain": med(ratio_spec),
                "ratio_by_kind": {kind: med(v) for kind, v in sorted(per_kind.items())},
                "tokens_per_s_by_kind": {kind: med([r.tokens_per_s for r in mine if r.kind == kind])
                                         for kind in sorted({r.kind for r in mine})},
                "greedy_equal_own_plain": f"{equal_own}/{compared_own}" if compared_own else None,
                "greedy_equal_spec_edge_fp32": f"{equal_spec}/{compared_spec}" if compared_spec else None,
                "memory_mb": round(s.memory_mb), "note": s.note})
    return {"rows": rows, "costs": {w: c for w, c in costs.items()}, "mismatches_spec": mismatches_spec,
            "mismatches_peer": mismatches_peer,
            "runs": [asdict(r) | {"token_ids": None, "n_tokens": len(r.token_ids)} for r in runs],
            "prompts": [{"id": p["id"], "kind": p["kind"], "prompt_tokens": len(prompt_ids[p["id"]])} for p in prompts]}


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_report(report: dict) -> str:
    lines = [f"spec-edge bench ({report['mode']}), {report['date']}; load average {report['load_start']['loadavg_1m']}"
             f" -> {report['load_end']['loadavg_1m']} on {report['load_start']['cpus']} cores; "
             f"max_new_tokens {report['max_new_tokens']}, repeats {report['repeats']}"]
    for w, c in report["costs"].items():
        lines.append(f"  spec_edge[{w}]: step {c['step_ms']:.1f} ms; " + ", ".join(
            f"verify[{int(k) + 1}] {v:.1f} ms ({c['verify_over_step'][k]:.2f} steps)" for k, v in c["verify_ms"].items()))
    header = (f"{'system':44s} {'T':>4s} {'tok/s':>6s} {'ttft ms':>7s} {'accept':>6s} {'len':>5s} "
              f"{'tok/call':>8s} {'dr ms':>5s} {'x own':>6s} {'x se32':>6s} {'=own':>6s} {'=se32':>6s} {'MB':>5s}")
    lines.append(header)
    lines.append("-" * len(header))
    for row in report["rows"]:
        lines.append(
            f"{row['system'][:44]:44s} {row['temperature']:4.1f} {_fmt(row['tokens_per_s'], '6.1f'):>6s} "
            f"{_fmt(row['ttft_ms'], '7.0f'):>7s} {_fmt(row['acceptance'], '6.2f'):>6s} "
            f"{_fmt(row['mean_accepted_length'], '5.2f'):>5s} {_fmt(row['tokens_per_target_call'], '8.2f'):>8s} "
            f"{_fmt(row['draft_ms_per_token'], '5.1f'):>5s} {_fmt(row['ratio_to_own_plain'], '6.2f'):>6s} "
            f"{_fmt(row['ratio_to_spec_edge_fp32_plain'], '6.2f'):>6s} {row['greedy_equal_own_plain'] or '-':>6s} "
            f"{row['greedy_equal_spec_edge_fp32'] or '-':>6s} {row['memory_mb']:5d}")
    kinds = sorted({k for row in report["rows"] for k in row["ratio_by_kind"]})
    lines.append("speed-up over own plain decode per prompt kind (T=0):")
    lines.append(f"  {'system':44s} " + " ".join(f"{k:>13s}" for k in kinds))
    for row in report["rows"]:
        if row["temperature"] == 0.0 and row["drafter"] != "none":
            lines.append(f"  {row['system'][:44]:44s} " + " ".join(
                f"{_fmt(row['ratio_by_kind'].get(k), '13.2f'):>13s}" for k in kinds))
    lines.append("columns: tok/call = tokens per target call (verify or step); dr ms = drafting ms per token; "
                 "x own = tok/s over the same family's plain decode (same round); x se32 = over spec_edge "
                 "fp32 target-only; =own / =se32 = greedy runs whose tokens equal that baseline's")
    lines += verdict(report["rows"])
    for m in report["mismatches_spec"]:
        why = (" (expected for q4 with the exported attention: its one-row calls sum otherwise; see "
               "spec_edge/graphs/two_rows.py)" if m.get("weights", "") in INEXACT_VARIANTS else "")
        lines.append(f"  MISMATCH {m['system']} on {m['prompt']} (repeat {m['repeat']}): first differing token "
                     f"{m['first_diff']} vs {m['vs']}; fp32 top-2 margin {_fmt(m.get('fp32_top2_margin'), '.2e')}{why}")
    for m in report["mismatches_peer"]:
        lines.append(f"  peer differs: {m['system']} on {m['prompt']} (repeat {m['repeat']}) from {m['vs']} at token "
                     f"{m['first_diff']}; fp32 top-2 margin {_fmt(m.get('fp32_top2_margin'), '.2e')}")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    lines.append(f"peak RSS of the bench process {report['peak_rss_mb']:.0f} MB (MB column: memory added when that "
                 f"system was loaded)")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> list[str]:
    """At T=0, in within-round ratios (absolute medians drift with the machine's load): the best spec_edge
    speculative system per weights, in units of spec_edge fp32 target-only; with peers in the run (bench/peers.py)
    also against every peer (a peer below fp32 precision marked), and our best speed-up over our own plain decode
    against each speculative peer's over its own."""
    rows0 = [r for r in rows if r["temperature"] == 0.0 and r["ratio_to_spec_edge_fp32_plain"]]
    out = []
    for weights in sorted({r["weights"] for r in rows0 if r["family"] == "spec_edge"}):
        spec = [r for r in rows0 if r["family"] == "spec_edge" and r["weights"] == weights and r["drafter"] != "none"]
        if not spec:
            continue
        best = max(spec, key=lambda r: r["ratio_to_spec_edge_fp32_plain"])
        ours = best["ratio_to_spec_edge_fp32_plain"]
        out.append(f"best spec_edge[{weights}] speculative: {best['system']} {ours:.2f}x spec_edge fp32 target-only "
                   f"({best['ratio_to_own_plain']:.2f}x its own plain)")
        for peer in (r for r in rows0 if r["family"] != "spec_edge"):
            low = (f" [peer runs lower precision: {peer['weights']}]" if peer["weights"] != "fp32" and weights == "fp32"
                   else "")
            status = "above" if ours > peer["ratio_to_spec_edge_fp32_plain"] else "BELOW"
            out.append(f"  {status} {peer['system']} {peer['ratio_to_spec_edge_fp32_plain']:.2f}x{low}")
        for peer in (r for r in rows0 if r["family"] != "spec_edge" and r["drafter"] != "none"):
            status = "above" if (best["ratio_to_own_plain"] or 0) > (peer["ratio_to_own_plain"] or 0) else "BELOW"
            out.append(f"  speed-up over own plain: ours {best['ratio_to_own_plain']:.2f}x {status} "
                       f"{peer['system']} {peer['ratio_to_own_plain']:.2f}x")
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    rows0 = [r for r in report["rows"] if r["temperature"] == 0.0]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for w in sorted({r["weights"] for r in rows0 if r["family"] == "spec_edge"}):
        plain = next((r for r in rows0 if r["family"] == "spec_edge" and r["weights"] == w and r["drafter"] == "none"), None)
        for d in sorted({r["drafter"] for r in rows0 if r["family"] == "spec_edge" and r["drafter"] != "none"}):
            pts = sorted((r["k"], r["tokens_per_s"]) for r in rows0 if r["family"] == "spec_edge" and r["weights"] == w
                         and r["drafter"] == d and r["note"] != "k auto")
            if pts:
                xs, ys = zip(*pts)
                if plain:
                    xs, ys = (0,) + xs, (plain["tokens_per_s"],) + ys
                ax.plot(xs, ys, marker="o", label=f"{d} ({w})")
    for r in rows0:
        if r["family"] != "spec_edge" and r["drafter"] == "none":
            ax.axhline(r["tokens_per_s"], ls="--", lw=0.8, c="grey")
            ax.text(0, r["tokens_per_s"], r["system"], fontsize=7, va="bottom")
    ax.set_xlabel("k (0 = target-only)")
    ax.set_ylabel("tokens/s (median, T=0)")
    ax.set_title("tok/s vs k per drafter", fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[1]
    kinds = sorted({k for r in rows0 for k in r["ratio_by_kind"]})
    spec_rows = [r for r in rows0 if r["drafter"] != "none"]
    best = {}
    for r in spec_rows:  # per family/weights/drafter keep the best k
        key = (r["family"], r["weights"], r["drafter"])
        if key not in best or (r["ratio_to_own_plain"] or 0) > (best[key]["ratio_to_own_plain"] or 0):
            best[key] = r
    chosen = list(best.values())
    width = 0.8 / max(1, len(chosen))
    for i, r in enumerate(chosen):
        xs = [j + i * width for j in range(len(kinds))]
        ax.bar(xs, [r["ratio_by_kind"].get(k) or 0 for k in kinds], width=width, label=r["system"])
    ax.axhline(1.0, c="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))])
    ax.set_xticklabels(kinds, fontsize=8)
    ax.set_ylabel("speed-up over own plain decode")
    ax.set_title("speed-up per prompt kind (best k per system)", fontsize=10)
    ax.legend(fontsize=6)
    ax = axes[2]
    temps = sorted({r["temperature"] for r in report["rows"]})
    for key in sorted({(r["system"]) for r in report["rows"] if r["drafter"] != "none"}):
        pts = sorted((r["temperature"], r["ratio_to_own_plain"] or 0, r["acceptance"] or 0)
                     for r in report["rows"] if r["system"] == key)
        if len(pts) > 1:
            ts, ratios, acc = zip(*pts)
            line, = ax.plot(ts, ratios, marker="o", label=f"{key} speed-up")
            ax.plot(ts, acc, marker="x", ls=":", c=line.get_color(), label=f"{key} acceptance")
    ax.set_xlabel("temperature")
    ax.set_title("speed-up (solid) and acceptance (dotted) vs temperature", fontsize=10)
    if len(temps) > 1:
        ax.legend(fontsize=6)
    else:  # say why the panel is empty
        ax.text(0.5, 0.5, f"measured at T = {temps[0] if temps else '-'} only:\nadd --temperatures 0 0.7 1.0",
                ha="center", va="center", fontsize=9, transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
