"""ONNX Runtime on the CPU: runs the exported ONNX files as they are (the embedded default backend).

State, allocated once per runner:
  k_cache, v_cache   (L, Hkv, S, D) float32  resident cache, bound to every session by pointer,
                                             one view per layer (inputs k_cache_<i>, v_cache_<i>)
  per graph: tokens (1, T) int64, position (1,), logits (T, V), k_new / v_new (L, Hkv, T, D)
Inputs and outputs are bound with IO binding to these numpy buffers, so a call copies nothing but
the new keys/values (T rows per layer) into the cache. Graphs with fused attention (manifest
"attention": "fused", spec_edge/graphs/ort_attention.py) write those rows themselves: their k_present_<i>
outputs are bound to the same (1, Hkv, cache_rows, D) views as their k_cache_<i> inputs, and the
cache has cache_rows = S + prefill chunk rows (room for a padded chunk's padding).

OrtRunner runs a folder's rows=1 graphs (export.graph_plan); the graphs of m > 1 rows beside them run in
ort_batch.BatchRunner.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.config import Config
from spec_edge.graphs import export, io_names, ort_attention, quantize
from spec_edge.graphs.export import read_model_config
from spec_edge.runtime.backends.base import BackendError, Runner

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


def ensure_packed(graph_dir: Path, threads: int = 0, progress: Callable[[str], None] = print,
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


def graph_session(graph_dir: Path, stem: str, threads: int = 0, progress: Callable[[str], None] = print):
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


@dataclass
class _Graph:
    session: object
    binding: object
    tokens: np.ndarray      # (1, T) int64
    position: np.ndarray    # (1,) int64
    last_index: np.ndarray | None  # (1,) int64, prefill only
    logits: np.ndarray      # (T, V) or (1, V) float32
    k_new: np.ndarray | None  # (L, Hkv, T, D); None for fused attention (the graph writes the cache)
    v_new: np.ndarray | None
    hidden: np.ndarray | None = None  # (T, 3 * hidden) EAGLE-3 graphs only

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


class OrtRunner(Runner):
    def __init__(self, graph_dir: str | Path, threads: int = 0, *, _shared_from: "OrtRunner | None" = None,
                 _n_layers: int | None = None):
        import onnxruntime as ort

        self.graph_dir = Path(graph_dir)
        manifest_path = self.graph_dir / "manifest.json"
        if not manifest_path.is_file():
            raise BackendError(f"{self.graph_dir} holds no exported model (manifest.json missing): "
                               f"run `spec-edge export`")
        self.manifest = json.loads(manifest_path.read_text())
        self.model_cfg = read_model_config(self.graph_dir)
        self.max_context = int(self.manifest["max_context"])
        self.prefill_chunk = int(self.manifest["prefill_chunk"])
        self.vocab_size = self.model_cfg.vocab_size
        self.threads = _init_thread_pool(threads)
        self._ort = ort
        cfg = self.model_cfg
        self.fused = self.manifest.get("attention") == "fused"
        cache_rows = int(self.manifest.get("cache_rows", self.max_context))  # fused: S + prefill chunk
        if _shared_from is None:
            self.n_layers = cfg.n_layers
            shape = (cfg.n_layers, cfg.n_kv_heads, cache_rows, cfg.head_dim)  # (L, Hkv, S [+ C], D)
            self.k_cache = np.zeros(shape, np.float32)
            self.v_cache = np.zeros(shape, np.float32)
            stems = {s: spec for s, spec in self.manifest["graphs"].items()
                     if spec["kind"] != "layerskip" and spec.get("rows", 1) == 1}
        else:  # layer-skip: views of the target's first n layers, no copy
            self.n_layers = _n_layers
            self.k_cache = _shared_from.k_cache[:_n_layers]
            self.v_cache = _shared_from.v_cache[:_n_layers]
            stems = {s: spec for s, spec in self.manifest["graphs"].items()
                     if spec["kind"] == "layerskip" and spec.get("n_layers") == _n_layers and spec.get("rows", 1) == 1}
            if not stems:
                have = sorted({spec.get("n_layers") for spec in self.manifest["graphs"].values()} - {None})
                raise BackendError(f"no layer-skip graph with {_n_layers} layers was exported (have {have}); "
                                   f"set graphs.layer_skip_layers={_n_layers} and re-export")
        self._graphs: dict[int, _Graph] = {}
        self._prefill: _Graph | None = None
        # EAGLE-3: the hidden states of every processed position, written like the cache (rows
        # [position, position + n_valid) per call); None when the graphs were exported without them
        hidden_layers = {len(spec.get("hidden_layers", ())) for spec in stems.values()}
        width = max(hidden_layers) * cfg.hidden_size if hidden_layers else 0
        self.hidden = np.zeros((self.max_context, width), np.float32) if width else None  # (S, 3 * hidden)
        for stem, spec in stems.items():
            graph = self._load(stem, spec)
            if spec["kind"] == "prefill":
                self._prefill = graph
            else:
                self._graphs[spec["width"]] = graph
        self.widths = frozenset(self._graphs)

    def _load(self, stem: str, spec: dict) -> _Graph:
        ort = self._ort
        path = self.graph_dir / f"{stem}.onnx"
        session = graph_session(self.graph_dir, stem, self.threads)
        width = spec["width"]
        cfg = self.model_cfg
        prefill = spec["kind"] == "prefill"
        new_shape = (self.n_layers, cfg.n_kv_heads, width, cfg.head_dim)
        graph = _Graph(
            session=session, binding=session.io_binding(),
            tokens=np.zeros((1, width), np.int64), position=np.zeros((1,), np.int64),
            last_index=np.zeros((1,), np.int64) if prefill else None,
            logits=np.zeros((1 if prefill else width, cfg.vocab_size), np.float32),
            k_new=None if self.fused else np.zeros(new_shape, np.float32),
            v_new=None if self.fused else np.zeros(new_shape, np.float32))
        if spec.get("hidden_layers"):
            if self.hidden is None or self.hidden.shape[1] != len(spec["hidden_layers"]) * cfg.hidden_size:
                raise BackendError(f"{path}: graphs disagree on the hidden states they return: re-export")
            graph.hidden = np.zeros((width, self.hidden.shape[1]), np.float32)
        bind = graph.binding
        value = ort.OrtValue.ortvalue_from_numpy
        bind.bind_ortvalue_input(io_names.TOKENS, value(graph.tokens))
        bind.bind_ortvalue_input(io_names.POSITION, value(graph.position))
        for layer in range(self.n_layers):  # views of the resident cache, one per layer: no copy
            if self.fused:  # (1, Hkv, cache_rows, D), the same memory in and out: written in place
                k_layer, v_layer = value(self.k_cache[layer:layer + 1]), value(self.v_cache[layer:layer + 1])
                bind.bind_ortvalue_output(io_names.k_present(layer), k_layer)
                bind.bind_ortvalue_output(io_names.v_present(layer), v_layer)
            else:
                k_layer, v_layer = value(self.k_cache[layer]), value(self.v_cache[layer])
            bind.bind_ortvalue_input(io_names.k_cache(layer), k_layer)
            bind.bind_ortvalue_input(io_names.v_cache(layer), v_layer)
        if prefill:
            bind.bind_ortvalue_input(io_names.LAST_INDEX, value(graph.last_index))
        bind.bind_ortvalue_output(io_names.LOGITS, value(graph.logits))
        if not self.fused:
            bind.bind_ortvalue_output(io_names.K_NEW, value(graph.k_new))
            bind.bind_ortvalue_output(io_names.V_NEW, value(graph.v_new))
        if graph.hidden is not None:
            bind.bind_ortvalue_output(io_names.HIDDEN, value(graph.hidden))
        return graph

    def _write_cache(self, graph: _Graph, position: int, n_valid: int) -> None:
        if graph.k_new is not None:  # fused attention graphs wrote their rows already
            self.k_cache[:, :, position:position + n_valid] = graph.k_new[:, :, :n_valid]
            self.v_cache[:, :, position:position + n_valid] = graph.v_new[:, :, :n_valid]
        if graph.hidden is not None:
            self.hidden[position:position + n_valid] = graph.hidden[:n_valid]

    def hidden_states(self, start: int, stop: int) -> np.ndarray:
        if self.hidden is None:
            raise BackendError(f"{self.graph_dir} was exported without hidden-state outputs: set "
                               f"speculative.eagle3_head (or medusa_head / peagle_head) for the drafters that read "
                               f"the target's hidden states")
        return self.hidden[start:stop]

    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        width = len(token_ids)
        self.check_width(width)
        self.check_room(position, width)
        graph = self._graphs[width]
        graph.tokens[0, :] = token_ids
        graph.position[0] = position
        graph.run()
        self._write_cache(graph, position, width)
        return graph.logits

    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        if self._prefill is None:
            raise BackendError("this runner has no prefill graph")
        n_tokens = len(token_ids)
        if n_tokens == 0:
            raise BackendError("prefill needs at least one token")
        self.check_room(position, n_tokens)
        graph, chunk = self._prefill, self.prefill_chunk
        for start in range(0, n_tokens, chunk):
            part = token_ids[start:start + chunk]
            n_valid = len(part)
            # a short last chunk is padded at the end: causal masking keeps the padding out of the real
            # rows, and only the n_valid real rows are written to the cache (so padding may pass S)
            graph.tokens[0, :n_valid] = part
            graph.tokens[0, n_valid:] = part[-1]
            graph.position[0] = position + start
            graph.last_index[0] = n_valid - 1
            graph.run()
            self._write_cache(graph, position + start, n_valid)
        return graph.logits[0]

    def layer_skip(self, n_layers: int) -> "OrtRunner":
        if not 1 <= n_layers < self.model_cfg.n_layers:
            raise BackendError(f"layer-skip needs 1 <= n_layers < {self.model_cfg.n_layers}, got {n_layers}")
        return OrtRunner(self.graph_dir, self.threads, _shared_from=self, _n_layers=n_layers)


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
    then ort_graphs), for a B=1 runner (OrtRunner) as for B slots (ort_batch.BatchRunner)."""
    exported = export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress)
    return ort_graphs(cfg, "target", exported, progress)


def load_runner(cfg: Config, graph_dir: Path) -> Runner:
    """An ONNX Runtime runner over exported graphs."""
    return OrtRunner(graph_dir, cfg.runtime.threads)
