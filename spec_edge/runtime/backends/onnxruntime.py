"""ONNX Runtime on the CPU (the embedded default backend): the sessions of a graph folder and the folders
a config runs (ort_graphs, target_graphs); the runner around them is ort_runner.OrtRunner.

All sessions of the process share ONNX Runtime's global thread pool: with a pool per session
their spinning threads fight over the cores (mixed step/verify decoding fell from ~40 to ~23 tok/s
on 2 cores).

Weights once: a session's kernels keep their own pre-packed (MLAS-transformed) copy of every
weight, so N sessions over one folder (a graph per width, per row count, the layer-skip graph) would
hold the weights N times. Sessions of a graph folder therefore load its packed copy (packed_dir):
each graph as ONNX Runtime optimized it on this machine, with the pre-packed weights its kernels
made, and every distinct blob (weight or pre-packed weight) of all the folder's graphs stored once
in one weights.bin, which ONNX Runtime memory-maps. The pages of one blob are one physical copy
whatever the number of sessions that map it (a session maps each of its blobs itself, so VmRSS
counts a page once per mapping; the process's Pss counts it once).
"""
from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from spec_edge.config import Config
from spec_edge.graphs import export, ort_attention, quantize
from spec_edge.runtime.backends.base import BackendError

_POOL_THREADS: int | None = None


def to_stderr(message: str) -> None:
    """Where a load's progress goes when its caller names no place: stderr (stdout may be a --json answer)."""
    print(message, file=sys.stderr, flush=True)


def _init_thread_pool(threads: int) -> int:
    """Create the process-wide pool once (ONNX Runtime allows it only before its first session)."""
    global _POOL_THREADS
    import onnxruntime as ort

    wanted = threads or (os.cpu_count() or 1)
    if _POOL_THREADS is None:
        ort.set_global_thread_pool_sizes(wanted, 1)
        _POOL_THREADS = wanted
    return _POOL_THREADS


def _session_options(threads: int):
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

    return ort.InferenceSession(model, _session_options(threads), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------------------------
# Weights once: the packed copy of a graph folder

PACKED_FORMAT = 2  # bumped when the packed copy's layout changes (2: made graph by graph, weights.index.json)
PACKED_DATA = "weights.bin"
_PREPACKED = "prepacked"  # external-data keys "prepacked_<n>": "<kernel key>|offset;length;checksum[|...]"


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


def ensure_packed(graph_dir: Path, threads: int = 0, progress: Callable[[str], None] = to_stderr,
                  graphs: dict[str, dict] | None = None) -> Path:
    """The packed copy of graph_dir (see the module docstring) holding `graphs` (stem -> spec; default
    all of graph_dir's): made graph by graph beside it (<name>_packed/, export.ensure_graphs: a graph
    added later is packed into the same weights.bin), remade when the folder's identity, onnxruntime
    or the CPU changes. threads: as cpu_session (the process's pool is made by its first session,
    this one's if it packs first)."""
    from spec_edge.graphs.export import ensure_graphs, folder_stamp

    graph_dir = Path(graph_dir)
    have = json.loads((graph_dir / "manifest.json").read_text())["graphs"]
    graphs = dict(have) if graphs is None else graphs
    missing = sorted(set(graphs) - set(have))
    if missing:
        raise BackendError(f"{graph_dir} lacks the graphs {missing}: re-run `spec-edge export`")
    identity = {"packed_source_stamp": folder_stamp(graph_dir), "packed_machine": machine_stamp(),
                "packed_format": PACKED_FORMAT}

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        progress(f"[packed] {graph_dir.name}: pre-packing the weights of {len(todo)} graphs once ({folder.name}) ...")
        for stem in todo:
            _pack(graph_dir, stem, folder, store, threads)
        return {}

    return ensure_graphs(packed_dir(graph_dir), identity, graphs, make, progress, "[packed]")


def _pack(src: Path, stem: str, dst: Path, store, threads: int) -> None:
    """Write dst/<stem>.onnx: src's graph optimized by ONNX Runtime with its pre-packed weights saved
    (session.save_external_prepacked_constant_initializers), every blob moved into store by content."""
    import onnx
    import onnxruntime as ort

    optimized, data = dst / f"{stem}.optimized.onnx", dst / f"{stem}.optimized.data"
    options = _session_options(threads)
    options.optimized_model_filepath = str(optimized)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", data.name)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "4096")
    options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    try:
        ort.InferenceSession(str(src / f"{stem}.onnx"), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises several unrelated types for a bad file
        raise BackendError(f"ONNX Runtime cannot load {src / stem}.onnx: {err}; re-run `spec-edge export`") from err
    model = onnx.load(str(optimized), load_external_data=False)
    with data.open("rb") as blobs:
        def move(offset: int, length: int) -> int:
            blobs.seek(offset)
            return store.put(blobs.read(length))[0]

        for tensor in model.graph.initializer:  # (the graphs have no subgraphs)
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = PACKED_DATA
                elif entry.key == "offset":
                    length = int(next(e.value for e in tensor.external_data if e.key == "length"))
                    entry.value = str(move(int(entry.value), length))
                elif entry.key.startswith(_PREPACKED):
                    kernel, *parts = entry.value.split("|")
                    moved = []
                    for part in parts:
                        offset, length, checksum = part.split(";")
                        moved.append(f"{move(int(offset), int(length))};{length};{checksum}")
                    entry.value = "|".join([kernel, *moved])
    store.fh.flush()
    tmp = dst / f".{stem}.onnx.tmp"
    onnx.save_model(model, str(tmp))
    os.replace(tmp, dst / f"{stem}.onnx")
    optimized.unlink()
    data.unlink()


def graph_session(graph_dir: Path, stem: str, threads: int = 0, progress: Callable[[str], None] = to_stderr):
    """The session of graph <stem> of a graph folder, loaded from the folder's packed copy (packed now
    if it is not there yet), so all sessions over the folder share one copy of its weights and
    pre-packed weights (module docstring)."""
    graph_dir = Path(graph_dir)
    path = graph_dir / f"{stem}.onnx"
    specs = json.loads((graph_dir / "manifest.json").read_text())["graphs"]
    if stem not in specs or not path.is_file():
        raise BackendError(f"graph file {path} is missing: re-run `spec-edge export`")
    packed = ensure_packed(graph_dir, threads, progress, {stem: specs[stem]}) / f"{stem}.onnx"
    try:
        return cpu_session(str(packed), threads)
    except Exception as err:  # onnxruntime raises several unrelated types for a bad file
        raise BackendError(f"ONNX Runtime cannot load {packed}: {err}; delete {packed.parent} to pack "
                           f"{graph_dir.name} again") from err


# ---------------------------------------------------------------------------------------------
# What a config runs


def ort_graphs(cfg: Config, role: str, exported: Path, progress: Callable[[str], None]) -> Path:
    """The folder ONNX Runtime runs for an exported target or draft model, holding the graphs of the
    config's plan (export.graph_plan: with graphs.batch_slots > 1 the target's graphs of m > 1 rows
    too): the post-export passes the config asks for (fused attention, graphs/ort_attention.py; for
    the target with graphs.weights q4 / q4_fp32act also the GGUF's 4-bit blocks, graphs/quantize.py),
    then its packed copy (what its sessions load, graph_session), each made graph by graph."""
    plan = export.graph_plan(cfg, role)
    graph_dir = ort_attention.for_config(cfg, exported, progress, graphs=plan)
    if role == "target" and cfg.graphs.weights != "fp32":
        graph_dir = quantize.for_config(cfg, graph_dir, progress, graphs=plan)
    ensure_packed(graph_dir, cfg.runtime.threads, progress, plan)
    return graph_dir


def target_graphs(cfg: Config, progress: Callable[[str], None] = print) -> Path:
    """The target's graph folder ONNX Runtime runs for cfg (exported first where missing: export.export_model,
    then ort_graphs), for ort_runner.OrtRunner at graphs.batch_slots."""
    exported = export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress)
    return ort_graphs(cfg, "target", exported, progress)

