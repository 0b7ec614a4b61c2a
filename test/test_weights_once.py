"""Weights once (runtime/backends/onnxruntime.py, graph_session): the sessions of a graph folder load
its packed copy, whose one weights.bin holds every weight and pre-packed weight of all its graphs once;
the packed graphs compute what the exported ones do, bit for bit; and a node's memory is the weights
about once, whatever the number of its sessions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from spec_edge.artifacts import ensure_packed
from spec_edge.runtime.backends.onnxruntime import cpu_session, graph_session, packed_dir

REPO = Path(__file__).resolve().parents[1]


def _feeds(session, rng) -> dict:
    feeds = {}
    for arg in session.get_inputs():
        shape = tuple(arg.shape)
        if "int64" in arg.type:  # tokens, position, last_index: small values valid for every graph
            feeds[arg.name] = np.full(shape, 3, np.int64) if arg.name != "last_index" else np.zeros(shape, np.int64)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_packed_graphs_compute_what_the_exported_ones_do(tiny_engine):
    graph_dir = tiny_engine.graph_dir
    ensure_packed(graph_dir)  # every graph of the folder (the engine's build packed its plan's)
    rng = np.random.default_rng(0)
    for stem in json.loads((graph_dir / "manifest.json").read_text())["graphs"]:
        exported = cpu_session(str(graph_dir / f"{stem}.onnx"))
        packed = graph_session(graph_dir, stem)
        feeds = _feeds(exported, rng)
        for want, got in zip(exported.run(None, feeds), packed.run(None, feeds)):
            assert np.array_equal(want, got), stem


def test_each_blob_is_stored_once(tiny_engine):
    """Every graph of the folder points at the same bytes for the same weight and the same pre-packed
    weight: one copy on disk, and so one set of mapped pages in a process."""
    graph_dir = tiny_engine.graph_dir
    folder = ensure_packed(graph_dir)
    assert folder == packed_dir(graph_dir)
    offsets: dict[str, set[str]] = {}  # weight name / pre-packing kernel key -> the blobs it points at
    prepacked = 0
    for stem in json.loads((graph_dir / "manifest.json").read_text())["graphs"]:
        model = onnx.load(str(folder / f"{stem}.onnx"), load_external_data=False)
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry.value for entry in tensor.external_data}
            assert info["location"] == "weights.bin"
            offsets.setdefault(tensor.name, set()).add(info["offset"])
            for key, value in info.items():
                if key.startswith("prepacked"):
                    kernel, *blobs = value.split("|")
                    offsets.setdefault(kernel, set()).add("|".join(blob.split(";")[0] for blob in blobs))
                    prepacked += 1
    assert prepacked > 0, "no pre-packed weight was saved: every session would pack its own copy"
    assert all(len(places) == 1 for places in offsets.values()), {k: v for k, v in offsets.items() if len(v) > 1}
    assert not list(folder.glob("*.data")) and not list(folder.glob("*.optimized.onnx"))


_MEASURE = """
import json, sys
from pathlib import Path
from spec_edge.config import Config
from spec_edge import artifacts
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one

engine = artifacts.engine(Config().replace(**{"runtime.engine_dir": sys.argv[1], "graphs.weights": "fp32",
                                               "graphs.batch_slots": 1}), progress=lambda m: None)
if sys.argv[2] == "measure":
    run_one(engine, GenerateRequest(prompt="Explain in two sentences why robots use speculative decoding.",
                                    max_new_tokens=16))
    pss = anon = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        pss = int(value.split()[0]) * 1024 if key == "Pss" else pss
        anon = int(value.split()[0]) * 1024 if key == "Anonymous" else anon
    runner = engine.runner
    print(json.dumps({"pss": pss, "anon": anon, "sessions": len(runner.widths) + 1,
                      "weights": (engine.graph_dir / "weights.bin").stat().st_size,
                      "kv": runner.k_cache.nbytes + runner.v_cache.nbytes}))
"""


@pytest.mark.real_model("fp32")
def test_the_default_node_holds_its_weights_once():
    """The embedded default (fp32; a prefill, a step and a verify graph: three sessions): its Pss
    after a request stays under 1.5x weights.bin + the KV cache (three private pre-packed copies: ~2.9x), and
    its anonymous memory under half the weights. In a fresh process (a first start's export and packing
    leave their heap behind), after one that made the graphs."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    engines = str(REPO / "engines")
    for step in ("prepare", "measure"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, engines, step], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["sessions"] >= 3
    assert got["pss"] < 1.5 * (got["weights"] + got["kv"]), got
    assert got["anon"] < 0.5 * got["weights"], got
