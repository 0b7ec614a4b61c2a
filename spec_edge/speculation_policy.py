"""The load policy of serve.speculate_k_by_load, TensorRT Edge-LLM's (backends/edgellm.py): its k is fixed per
engine (the drafting chain is built into it), so under load the one thing to choose is whether a request
speculates at all. On ONNX Runtime speculative.k: auto chooses each request's k at every iteration
(runtime/k_choice.py) and config.validate refuses a table.

    serve.speculate_k_by_load: [4, 4, 0]

Entry n-1 is the k at load n, 0 = no speculation (plain steps); a load past the table's end keeps its last
entry, and [] (the default) is speculative.k at every load. The load is the requests in the engine: its
occupied slots + those waiting in the node's queue (1 = alone), looked up as a request starts. Greedy output
is the same token for token whatever k runs; with sampling each k is a different draw from the same
distribution.

Pure functions of the table and the config, shared by config.validate, the Edge-LLM engine and the reasons a
result gives (reason: also speculative.k auto's, from its runtime/k_choice.KChoice).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KEY = "serve.speculate_k_by_load"


def k_at(table: Sequence[int], load: int, k: int) -> int:
    """The drafts per verify call at this load for a request entitled to k."""
    if not table or k <= 0:
        return k
    return min(k, table[min(max(load, 1), len(table)) - 1])


def max_load(cfg: Any) -> tuple[int, str, str]:
    """(the largest load the node can see, what it counts, the settings that bound it) for cfg."""
    return (cfg.graphs.batch_slots + cfg.serve.queue_limit, "requests in the engine: occupied slots + queued",
            f"graphs.batch_slots={cfg.graphs.batch_slots} + serve.queue_limit={cfg.serve.queue_limit}")


def check(cfg: Any) -> str | None:
    """What is wrong with cfg's table (the message for ConfigError), or None."""
    table, g = list(cfg.serve.speculate_k_by_load), cfg.graphs
    for i, k in enumerate(table):
        if k != 0 and k not in g.k_values:
            return (f"{KEY}[{i}] = {k} (load {i + 1}) has no verify graph: use 0 (no speculation) or one of "
                    f"graphs.k_values {list(g.k_values)}")
    loads, what, bound = max_load(cfg)
    if len(table) > loads:
        return (f"{KEY} has {len(table)} entries, one per load, but the load ({what}) is at most {bound}: drop "
                f"the last {len(table) - loads} (the last entry holds for every larger load)")
    return None


def from_max_queue(max_queue: int, k: int) -> list[int]:
    """The table of the old serve.speculate_max_queue (0 = never switch off)."""
    return [] if max_queue <= 0 else [k] * max_queue + [0]


def describe(table: Sequence[int]) -> str:
    """The table in words: 'k=4 at load 1-2, k=2 at 3, none from 4'."""
    if not table:
        return "speculative.k at every load"
    parts, start = [], 1
    for n in range(1, len(table) + 1):
        if n == len(table) or table[n] != table[n - 1]:
            what = f"k={table[n - 1]}" if table[n - 1] else "none"
            parts.append(f"{what} from {start}" if n == len(table) else
                         f"{what} at {start}" + (f"-{n}" if n > start else ""))
            start = n + 1
    return "load " + ", ".join(parts)


def reason(stats: Any, table: Sequence[int], choice: Any = None) -> str:
    """Why a request speculated less than it asked (stats.k) ("" = every verify call at its k, or it did
    not speculate): its verify calls by k and its plain steps under the policy, from its stats; with
    speculative.k auto (choice: its runtime/k_choice.KChoice) also the steps and smaller k the choice took."""
    k = stats.k
    fewer = sum(stats.verify_calls_by_k[:k - 1]) if k > 1 else 0
    if not k or (not stats.policy_off_steps and not fewer and not stats.auto_off_steps):
        return ""
    calls = [f"{n} verify calls at k={i + 1}" for i, n in enumerate(stats.verify_calls_by_k) if n]
    if choice is None:
        parts = calls + ([f"{stats.policy_off_steps} plain steps without speculation"] if stats.policy_off_steps else [])
        return f"by load (requests in the engine), {KEY}={list(table)}: " + ", ".join(parts) + f" (asked k={k})"
    out = (f"speculative.k auto (up to k={k}): " + ", ".join(calls + [
        f"{stats.auto_off_steps} plain steps where plain decoding was expected faster ({choice.probes} probes)"])
           + (f"; last choice: {choice.why}" if choice.why else ""))
    if stats.policy_off_steps:
        out += f"; by load, {KEY}={list(table)}: {stats.policy_off_steps} plain steps without speculation"
    return out
