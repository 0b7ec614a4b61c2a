"""The soak script, short: 8 client processes for 20 s against the default node with one burst of slots +
queue_limit while they pause; nothing lost, nothing busy, the burst served in full (the full soak,
`scripts/soak.py --duration 600`, stays a script: docs/ros.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from rosutil import REPO

# the release tier (docs/testing.md): load over time; CI serves concurrent clients in test_generate_node.py
# (eight clients), test_node_as_found.py (16 fresh streaming clients) and test_node_batch.py
pytestmark = [pytest.mark.release, pytest.mark.real_model("default")]


def test_soak_20s_loses_nothing(module_env, tmp_path):
    summary_path = tmp_path / "soak.json"
    params = tmp_path / "default.yaml"  # the default profile on <repo>/engines, where the session made its graphs
    tree = yaml.safe_load((REPO / "config" / "default.yaml").read_text())
    tree["/**"]["ros__parameters"].setdefault("runtime", {})["engine_dir"] = str(REPO / "engines")
    params.write_text(yaml.safe_dump(tree))
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--duration", "20", "--clients", "8", "--burst-every", "8",
         "--params", str(params), "--log", str(tmp_path / "node.log"), "--json", str(summary_path)],
        env=module_env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    counts = summary["counts"]
    assert proc.returncode == 0, (json.dumps({k: summary[k] for k in ("counts", "bursts", "greedy_identical",
                                                                      "clients_ok", "problems")}), proc.stderr[-3000:])
    assert counts["lost"] == 0 and counts["failed"] == 0 and summary["greedy_identical"]
    assert counts["sent"] == sum(counts[k] for k in ("answered", "refused", "busy", "cancelled", "timed_out",
                                                     "failed", "lost"))
    assert counts["busy"] == 0, summary  # 8 clients and a burst while they pause stay within the capacity
    bursts = summary["bursts"]
    assert bursts["n"] == 1 and bursts["size"] == summary["capacity"] and not bursts["not_served"], bursts
    assert counts["answered"] > 0 and summary["node_exit"] == 0
