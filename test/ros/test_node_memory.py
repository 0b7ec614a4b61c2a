"""Memory across lifecycle cycles: cleanup gives the engine back, configure takes the same again."""
from __future__ import annotations

import re
import sys

import pytest

from rosutil import Server, run_client, write_params

pytestmark = pytest.mark.release

CYCLES = 10


def rss_mb(pid: int) -> float:
    import os
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def test_rss_stays_flat_over_cleanup_configure_cycles(module_env, tmp_path, tiny_models):
    params = write_params(tmp_path / "tiny.yaml", {
        "model.target": str(tiny_models["target"]), "graphs.max_context": 128, "graphs.prefill_chunk": 16,
        "graphs.k_values": [4], "graphs.weights": "fp32", "graphs.batch_slots": 1,
        "runtime.engine_dir": str(tiny_models["root"] / "engines_memory"),
        "graphs.layer_skip_layers": 2, "runtime.profile": "tiny", "speculative.drafter": "ngram"})
    server = Server(module_env, params, tmp_path / "memory.log", argv=[
        sys.executable, "-m", "spec_edge.ros2.node", "--no-autostart", "--ros-args", "--params-file", str(params)])
    server.start(ready="waiting for a lifecycle manager")
    request = {"prompt": "hello there", "max_new_tokens": 8, "temperature": 0.0}
    try:
        first = run_client(module_env, {"mode": "lifecycle", "node": "/spec_edge", "request": request,
                                        "transitions": ["configure", "activate"]})
        assert first["served"]["success"], first["served"]["message"]
        after_first = rss_mb(server.proc.pid)
        cycles = run_client(module_env, {"mode": "lifecycle", "node": "/spec_edge", "request": request,
                                         "transitions": ["deactivate", "cleanup", "configure", "activate"] * CYCLES})
        assert cycles["served"]["success"] and cycles["served"]["text"] == first["served"]["text"]
        after_cycles = rss_mb(server.proc.pid)
        log = server.log()
    finally:
        server.stop()
    loaded = [float(m) for m in re.findall(r"engine loaded in .* \(RSS (\d+) MB\)", log)]
    freed = [float(m) for m in re.findall(r"engine freed \(RSS now (\d+) MB\)", log)]
    assert len(loaded) == CYCLES + 1 and len(freed) == CYCLES, log[-3000:]
    assert after_cycles <= 1.05 * after_first, (after_first, after_cycles, loaded, freed)
    assert max(loaded) <= 1.05 * loaded[0], loaded
    assert max(freed) <= 1.05 * min(freed), freed  # what cleanup leaves does not pile up either
