"""ONNX export of the static graphs of one model.

    <out_dir>/
      manifest.json             what was exported, from which checkpoint (fingerprint), with which shapes
      model.json                the ModelConfig
      tokenizer.json            tokenizers-library file; tokenizer_config.json: chat template, bos/eos
      weights.bin               every weight once, 4 KiB aligned; all graphs point into it
      prefill_<C>.onnx          (1, C) chunk -> logits of the last real token
      step_1.onnx               (1, 1)
      verify_<k+1>.onnx         (1, k+1), one per k in graphs.k_values
      layerskip<N>_step_1.onnx  first N layers + norm + head (target only)

Graphs come from torch.onnx.export's dynamo exporter (opset 20), which keeps every shape static;
check_static() proves it on each file. Weights shared by graphs are stored once, so the layer-skip
graph and the three target shapes cost no extra disk.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from spec_edge.config import Config, ConfigError, ModelConfig, engine_root
from spec_edge.graphs import hidden, io_names

FORMAT_VERSION, ALIGN = 2, 4096  # format 2: one cache input per layer, two-part attention, fusable RMSNorm
Progress = Callable[[str], None]


def torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def graph_plan(cfg: Config, role: str) -> dict[str, dict]:
    """stem -> {kind, width, n_layers}: the graphs a role ('target' or 'draft') needs."""
    g = cfg.graphs
    plan = {io_names.graph_file("prefill", g.prefill_chunk): {"kind": "prefill", "width": g.prefill_chunk},
            io_names.graph_file("step", 1): {"kind": "step", "width": 1}}
    if role == "target":
        for k in sorted(set(g.k_values)):
            plan[io_names.graph_file("verify", k + 1)] = {"kind": "verify", "width": k + 1}
        plan[io_names.graph_file(f"layerskip{g.layer_skip_layers}_step", 1)] = {
            "kind": "layerskip", "width": 1, "n_layers": g.layer_skip_layers}
        hidden_layers = hidden.target_hidden_layers(cfg)
        if hidden_layers:  # a head is configured: the full-model graphs also return the hidden states it reads
            for spec in plan.values():
                if spec["kind"] in ("prefill", "step", "verify"):
                    spec["hidden_layers"] = list(hidden_layers)
    return plan


def wanted_manifest(cfg: Config, role: str, fingerprint: str, source: str) -> dict:
    g = cfg.graphs
    return {"format": FORMAT_VERSION, "role": role, "source": source, "fingerprint": fingerprint,
            "max_context": g.max_context, "prefill_chunk": g.prefill_chunk, "dtype": g.dtype,
            "graphs": graph_plan(cfg, role)}


def up_to_date(out_dir: Path, wanted: dict) -> bool:
    """True when out_dir holds every wanted graph from the same checkpoint with the same shapes."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return False
    try:
        have = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    same = all(have.get(key) == wanted[key] for key in
               ("format", "role", "fingerprint", "max_context", "prefill_chunk", "dtype"))
    graphs = have.get("graphs", {})
    return same and all(graphs.get(stem) == spec and (out_dir / f"{stem}.onnx").is_file()
                        for stem, spec in wanted["graphs"].items())


def export_model(cfg: Config, role: str, out_dir: Path, progress: Progress = print) -> Path:
    """Export the graphs of the target ('target') or draft ('draft') model into out_dir, unless
    an up-to-date export is already there. Returns out_dir.

    Safe against concurrent exporters (a CLI and a node started together): an exclusive lock file
    beside out_dir serialises them, and a new export is written to a temporary folder that replaces
    out_dir only once complete, so a reader never sees half an export."""
    import fcntl

    from spec_edge.graphs import weights

    source = cfg.model.target if role == "target" else cfg.model.draft
    if not source:
        raise ConfigError(f"no {role} model configured (model.{role})")
    fingerprint = weights.fingerprint(source)
    wanted = wanted_manifest(cfg, role, fingerprint, source)
    out_dir = Path(out_dir)
    if up_to_date(out_dir, wanted):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        if not _try_lock(lock):
            progress(f"[export] {role}: another process is exporting to {out_dir}; waiting ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if up_to_date(out_dir, wanted):
            return out_dir
        for leftover in out_dir.parent.glob(f".{out_dir.name}.tmp*"):  # from an interrupted export
            _remove_tree(leftover)
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp{os.getpid()}"
        _export_into(cfg, role, source, wanted, tmp_dir, progress)
        old_dir = out_dir.parent / f".{out_dir.name}.old{os.getpid()}"
        if out_dir.exists():
            out_dir.rename(old_dir)
        tmp_dir.rename(out_dir)
        _remove_tree(old_dir)
    progress(f"[export] {role}: ready in {out_dir}")
    return out_dir


def _try_lock(lock) -> bool:
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _remove_tree(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)


def load_into(cfg: Config, source: str, out_dir: Path) -> tuple:
    """(model config, state dict, tokenizer, WeightStore of the new folder out_dir) of source, checked to
    cover graphs.max_context: how every export starts (this one, batch_export.py)."""
    from spec_edge.graphs import weights

    model_cfg, state, tokenizer = weights.load(source)
    if cfg.graphs.max_context > model_cfg.max_position_embeddings:
        raise ConfigError(f"graphs.max_context={cfg.graphs.max_context} exceeds the model's "
                          f"{model_cfg.max_position_embeddings} positions")
    out_dir.mkdir(parents=True)
    return model_cfg, state, tokenizer, WeightStore(out_dir / "weights.bin")


def _export_into(cfg: Config, role: str, source: str, wanted: dict, out_dir: Path, progress: Progress) -> None:
    from spec_edge.graphs import weights

    started = time.monotonic()
    progress(f"[export] {role}: loading {source} ...")
    model_cfg, state, tokenizer, store = load_into(cfg, source, out_dir)
    if role == "target" and cfg.graphs.layer_skip_layers >= model_cfg.n_layers:
        raise ConfigError(f"graphs.layer_skip_layers={cfg.graphs.layer_skip_layers} must be below the "
                          f"model's {model_cfg.n_layers} layers")
    plan = wanted["graphs"]
    for i, (stem, spec) in enumerate(plan.items(), 1):
        progress(f"[export] {role}: graph {i}/{len(plan)} {stem} (width {spec['width']}) ...")
        export_graph(model_cfg, state, out_dir / f"{stem}.onnx", store, kind=spec["kind"],
                     width=spec["width"], max_context=cfg.graphs.max_context, dtype=cfg.graphs.dtype,
                     n_layers=spec.get("n_layers"), hidden_layers=tuple(spec.get("hidden_layers", ())))
    store.close()
    weights.write_side_files(out_dir, model_cfg, tokenizer)
    manifest = dict(wanted, model=model_cfg.name, weights_bytes=store.size,
                    export_seconds=round(time.monotonic() - started, 1))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[export] {role}: {len(plan)} graphs in {manifest['export_seconds']} s")


def read_model_config(out_dir: Path) -> ModelConfig:
    raw = json.loads((Path(out_dir) / "model.json").read_text())
    if raw.get("rope_llama3") is not None:
        raw["rope_llama3"] = tuple(raw["rope_llama3"])
    raw["eos_ids"] = tuple(raw["eos_ids"])
    return ModelConfig(**raw)


class WeightStore:
    """One file holding each distinct large initializer once; graphs reference it by offset."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = path.open("wb")
        self.size = 0
        self.offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)

    def put(self, data: bytes) -> tuple[int, int]:
        key = hashlib.sha256(data).hexdigest()
        if key not in self.offsets:
            pad = (-self.size) % ALIGN
            self.fh.write(b"\0" * pad)
            self.offsets[key] = (self.size + pad, len(data))
            self.fh.write(data)
            self.size += pad + len(data)
        return self.offsets[key]

    def close(self) -> None:
        self.fh.close()


def export_graph(model_cfg: ModelConfig, state: dict, path: Path, store: WeightStore, *, kind: str,
                 width: int, max_context: int, dtype: str = "float32", n_layers: int | None = None,
                 hidden_layers: tuple[int, ...] = ()) -> None:
    """Export one static graph to path, its large weights moved into store."""
    import torch

    from spec_edge.graphs import model as model_mod

    layers = n_layers or model_cfg.n_layers
    prefill = kind == "prefill"
    module = model_mod.build(model_cfg, state, n_layers=n_layers, dtype=torch_dtype(dtype),
                             hidden_layers=hidden_layers, cls=model_mod.LayerCaches)
    module.prefill = prefill
    k_cache, v_cache = model_mod.empty_cache(model_cfg, max_context, layers, dtype=torch_dtype(dtype))
    args = (torch.zeros(1, width, dtype=torch.int64), torch.tensor([0]))
    if prefill:
        args = args + (torch.tensor([width - 1]),)
    args = args + tuple(layer.clone() for layer in (*k_cache, *v_cache))  # one (Hkv, S, D) input per layer
    outputs = list(io_names.GRAPH_OUTPUTS) + ([io_names.HIDDEN] if hidden_layers else [])
    save_static(module, args, io_names.graph_inputs(layers, prefill), outputs, path, store)


def save_static(module, args: tuple, inputs: list[str], outputs: list[str], path: Path, store: WeightStore) -> None:
    """Trace module into a static graph saved at path, its large weights moved into store."""
    graph = trace(module, args, inputs, outputs)
    check_static(graph, path.name)
    save(graph, path, store)


def trace(module, args: tuple, inputs: list[str], outputs: list[str]):
    """torch.onnx's dynamo exporter (opset 20, optimized), quietly; returns the ModelProto."""
    import onnx
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "graph.onnx"
        quiet = logging.getLogger("torch.onnx")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                # torch's own pytree deprecation notice, raised for forward(*caches): not the user's to act on
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                torch.onnx.export(module, args, str(tmp_path), dynamo=True, opset_version=20,
                                  input_names=inputs, output_names=outputs, external_data=True,
                                  optimize=True, verbose=False)
        finally:
            quiet.setLevel(level)
        return onnx.load(str(tmp_path), load_external_data=True)


def save(graph, path: Path, store: WeightStore) -> None:
    """Save graph to path with every large initializer moved into store (stored once, by content)."""
    import onnx

    for tensor in graph.graph.initializer:
        if tensor.HasField("raw_data") and len(tensor.raw_data) >= ALIGN:
            offset, length = store.put(tensor.raw_data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", store.path.name), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    store.fh.flush()
    onnx.save_model(graph, str(path))


def dynamic_tensors(graph) -> tuple[int, list[str]]:
    """(number of tensors checked, names of those without a fully static shape) of an ONNX graph."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(graph, strict_mode=True)
    values = list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)
    bad = [v.name for v in values if not v.type.tensor_type.HasField("shape")
           or any(not d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)]
    return len(values), bad


def check_static(graph, name: str = "graph") -> None:
    """Raise if any input, output or intermediate tensor of the graph has a symbolic dimension."""
    _, dynamic = dynamic_tensors(graph)
    if dynamic:
        raise RuntimeError(f"{name}: {len(dynamic)} tensors have dynamic shapes, e.g. {dynamic[:5]}")


def artifact_dir(cfg: Config, role: str) -> Path:
    return engine_root(cfg) / cfg.runtime.profile / "onnx" / role


def head_side_files(folder: Path) -> tuple[str, ...]:
    """What a head folder holds besides its graphs, weights.bin and manifest (head.json, draft_ids.npy,
    an own embedding): the files a post-export pass copies unchanged."""
    return tuple(sorted(path.name for path in Path(folder).iterdir()
                        if path.suffix in (".json", ".npy") and path.name != "manifest.json"))


def source_stamp(folder: Path) -> str:
    """A short hash of a graph folder's manifest: what a folder derived from it records."""
    return hashlib.sha256((Path(folder) / "manifest.json").read_bytes()).hexdigest()[:16]


def ensure_derived(out: Path, wanted: dict, make: Callable[[Path], None]) -> Path:
    """A folder that a post-export pass (quantize.py, ort_attention.py) makes from another: made
    once by make(tmp) under a lock and renamed into place, remade when its manifest does not carry
    every value of wanted (the source's stamp, the pass's format ...)."""
    import fcntl
    import shutil

    def current() -> bool:
        path = out / "manifest.json"
        if not path.is_file():
            return False
        have = json.loads(path.read_text())
        return all(have.get(key) == value for key, value in wanted.items())

    if current():
        return out
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if current():
            return out
        tmp = out.parent / f".{out.name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        make(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out
