"""ONNX Runtime on the CPU (the embedded default backend): the sessions of a graph folder, loaded from
what the build made (spec_edge/artifacts.py; nothing here makes a file); the runner around them is
ort_runner.OrtRunner.

All sessions of the process share ONNX Runtime's global thread pool (a pool per session: their spinning
threads fight over the cores; docs/bench.md "Measurements behind the code").

Weights once: a session's kernels keep their own pre-packed (MLAS-transformed) copy of every
weight, so N sessions over one folder (a graph per width, per row count, the layer-skip graph) would
hold the weights N times. Sessions of a graph folder therefore load its packed copy (packed_dir):
each graph as ONNX Runtime optimized it on this machine, with the pre-packed weights its kernels
made (the build's last step, artifacts.ensure_packed), and every distinct blob (weight or pre-packed
weight) of all the folder's graphs stored once in one weights.bin, which ONNX Runtime memory-maps. The
pages of one blob are one physical copy whatever the number of sessions that map it (a session maps each
of its blobs itself, so VmRSS counts a page once per mapping; the process's Pss counts it once).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from spec_edge.config import Config
from spec_edge.graphs import plan
from spec_edge.graphs.folders import folder_stamp
from spec_edge.runtime.backends.base import BackendError

_POOL_THREADS: int | None = None


def _init_thread_pool(threads: int) -> int:
    """Create the process-wide pool once (ONNX Runtime allows it only before its first session)."""
    global _POOL_THREADS
    import onnxruntime as ort

    wanted = threads or (os.cpu_count() or 1)
    if _POOL_THREADS is None:
        ort.set_global_thread_pool_sizes(wanted, 1)
        _POOL_THREADS = wanted
    return _POOL_THREADS


def session_options(threads: int):
    """The options of every session of the process: once the global pool exists, ONNX Runtime refuses
    sessions with pools of their own."""
    import onnxruntime as ort

    _init_thread_pool(threads)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return options


def cpu_session(model: str | bytes, threads: int = 0):
    """An InferenceSession on the shared global thread pool, holding its own copy of the model's
    pre-packed weights. A graph of an exported folder loads through graph_session instead (its weights
    shared with the folder's other sessions)."""
    import onnxruntime as ort

    return ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------------------------
# Weights once: the packed copy of a graph folder

PACKED_FORMAT = 2  # bumped when the packed copy's layout changes (2: made graph by graph, weights.index.json)
# what a missing or stale artefact's refusal says to do
BUILD = ("make it with `spec-edge export` and this profile's options (`--config <its yaml>`; `spec-edge generate`, "
         "`serve`, `bench` and the node make what is missing when they start)")


def packed_dir(graph_dir: Path) -> Path:
    return graph_dir.parent / f"{graph_dir.name}_packed"


@functools.cache
def machine_stamp() -> str:
    """What the pre-packed layout depends on: the onnxruntime version and this CPU (its architecture and
    instruction-set flags; MLAS picks its kernels, and so the packed layout, by them)."""
    import hashlib
    import platform

    import onnxruntime as ort

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip().lower() in ("flags", "features"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return hashlib.sha256(f"{ort.__version__}|{platform.machine()}|{flags}".encode()).hexdigest()[:16]


def packed_identity(graph_dir: Path) -> dict:
    """What graph_dir's packed copy is made for (its manifest's identity): the folder's identity, this
    onnxruntime and this CPU."""
    return {"packed_source_stamp": folder_stamp(graph_dir), "packed_machine": machine_stamp(),
            "packed_format": PACKED_FORMAT}


def built(folder: Path, what: str) -> Path:
    """folder, when a build made it; else BackendError naming the command that makes it."""
    if not (Path(folder) / "manifest.json").is_file():
        raise BackendError(f"{what} is not built ({folder} is missing): {BUILD}")
    return Path(folder)


def ort_folder(cfg: Config, role: str) -> Path:
    """The folder ONNX Runtime runs for a role of cfg (graphs/plan.ort_dir: 'target', 'draft' or a head kind), as
    the build made it; BackendError naming the command that makes it when it is not there."""
    what = f"the {role} graphs of profile '{cfg.runtime.profile}'"
    built(plan.artifact_dir(cfg, role), what)  # plan.ort_dir reads the export's form
    return built(plan.ort_dir(cfg, role), what)


def packed_graphs(graph_dir: Path) -> dict[str, dict]:
    """stem -> spec of the graphs of graph_dir that the build packed for this machine (what its sessions may
    load); BackendError naming the build command when the packed copy is missing or was made for another
    folder, onnxruntime or CPU."""
    graph_dir = built(Path(graph_dir), f"graph folder {Path(graph_dir).name}")
    try:
        manifest = json.loads((packed_dir(graph_dir) / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        manifest = {}
    if not manifest or any(manifest.get(key) != value for key, value in packed_identity(graph_dir).items()):
        raise BackendError(f"{graph_dir.name} is not packed for this machine ({packed_dir(graph_dir)}): {BUILD}")
    return manifest["graphs"]


def graph_session(graph_dir: Path, stem: str, threads: int = 0):
    """The session of graph <stem> of a graph folder, loaded from the folder's packed copy (made by the build,
    spec_edge/artifacts.py), so all sessions over the folder share one copy of its weights and pre-packed
    weights (module docstring); BackendError naming the build command when the copy lacks it (packed_graphs)."""
    packed = packed_dir(Path(graph_dir)) / f"{stem}.onnx"
    if stem not in packed_graphs(graph_dir) or not packed.is_file():
        raise BackendError(f"graph {stem} of {Path(graph_dir).name} is not packed for this machine "
                           f"({packed.parent}): {BUILD}")
    try:
        return cpu_session(str(packed), threads)
    except Exception as err:  # onnxruntime raises several unrelated types for a bad file
        raise BackendError(f"ONNX Runtime cannot load {packed}: {err}; delete {packed.parent} to pack "
                           f"{Path(graph_dir).name} again") from err
