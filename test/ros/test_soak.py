"""The soak script, short: 8 client processes for 20 s against the default node; nothing lost (the full soak,\n`scripts/soak.py --duration 600`, stays a script: docs/ros.md)."""
from __future__ import annotations

import json
import subprocess
import sys

from rosutil import REPO


def test_soak_20s_loses_nothing(module_env, tmp_path):
    summary_path = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--duration", "20", "--clients", "8",
         "--log", str(tmp_path / "node.log"), "--json", str(summary_path)],
        env=module_env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    counts = summary["counts"]
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert counts["lost"] == 0 and counts["failed"] == 0 and summary["greedy_identical"]
    assert counts["sent"] == sum(counts[k] for k in ("answered", "refused", "cancelled", "timed_out", "failed",
                                                     "lost"))
    assert counts["answered"] > 0 and summary["node_exit"] == 0
