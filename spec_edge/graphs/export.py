"""The export plan of a model and the graph folders made from it, graph by graph.

    <engine_dir>/<profile>/onnx/<form>/   the torch export (this module): the rows=1 graphs of one form,
                                          plan.artifact_dir(): target-c1024-p64-float32[-h1.14.26]-2f786409
                                          (folders.py: every name, the lock, the atomic writes)
      manifest.json             identity (checkpoint fingerprint, shapes, hidden states, format), "graphs":
                                stem -> spec, "made": what each run added, with its seconds
      model.json                the ModelConfig
      tokenizer.json            tokenizers-library file; tokenizer_config.json: chat template, bos/eos
      weights.bin               every weight once, 4 KiB aligned; all graphs point into it
      weights.index.json        sha256 -> (offset, length) of each blob: a later run appends, stored once
      prefill_<C>.onnx          (1, C) chunk -> logits of the last real token
      step_1.onnx               (1, 1)
      verify_<k+1>.onnx         (1, k+1), one per k in graphs.k_values
      layerskip<N>_step_1.onnx  first N layers + norm + head (target only)
    <form>_fused/   the same graphs with fused attention (ort_attention.py), plus graphs.batch_slots = B > 1's
      rows<m>_step_1.onnx, rows<m>_verify_<k+1>.onnx   (m, T) for each row count m of plan.row_counts(B), made
                                from step_1 by the rewrite (gqa_rewrite.rewrite_rows), no torch export
    <form>_fused_q4/ (quantize.py), <folder>_packed/ (spec_edge/artifacts.py): the same stems

plan.graph_plan(cfg, role) lists every graph a config runs, each with its row count ("rows": 1 for the
B=1 graphs). A folder is made graph by graph (ensure_graphs): a plan that grows (a new k, more batch
slots) adds only its missing graphs to the folders, their new weights appended to weights.bin; the
graphs already there, and the sessions that run them, are untouched. A plan of another form (a head's
hidden states, another max_context) has folders of its own: switching back to a form loads its folders.

Graphs come from torch.onnx.export's dynamo exporter (opset 20), which keeps every shape static;
check_static() proves it on each file. Weights shared by graphs are stored once, so the layer-skip
graph and the target shapes cost no extra disk.
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

from spec_edge.config import Config, ConfigError, ModelConfig
from spec_edge.graphs import folders, hidden, io_names
from spec_edge.graphs.plan import graph_plan

# format 3: every graph spec has its row count; weights.index.json lets a later run append
FORMAT_VERSION, ALIGN = 3, 4096
Progress = Callable[[str], None]
# make(todo, folder, store, fresh) writes todo's graphs (stem -> spec) into folder, their large weights into
# store (the folder's weights.bin); fresh: a new folder, whose side files (model.json ...) it writes too.
# Returns the manifest keys it adds (the same for every run over one identity)
MakeGraphs = Callable[[dict, Path, "WeightStore", bool], dict]


def torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def export_model(cfg: Config, role: str, out_dir: Path, progress: Progress = print) -> Path:
    """The folder of the target's ('target') or draft model's ('draft') exported rows=1 graphs of the
    plan: exported once, graph by graph (ensure_graphs: a grown plan exports only its new graphs; a
    new checkpoint re-exports the folder). out_dir: plan.artifact_dir(cfg, role), named by the form, so a
    new max_context, prefill chunk, dtype or set of hidden states goes to a folder of its own. Returns
    out_dir."""
    from spec_edge.graphs import weights

    source = cfg.model.target if role == "target" else cfg.model.draft
    if not source:
        raise ConfigError(f"no {role} model configured (model.{role})")
    g = cfg.graphs
    identity = {"format": FORMAT_VERSION, "role": role, "source": source, "fingerprint": weights.fingerprint(source),
                "max_context": g.max_context, "prefill_chunk": g.prefill_chunk, "dtype": g.dtype,
                "hidden_layers": list(hidden.target_hidden_layers(cfg)) if role == "target" else []}
    graphs = {stem: spec for stem, spec in graph_plan(cfg, role).items() if spec["rows"] == 1}

    def make(todo: dict, folder: Path, store: WeightStore, fresh: bool) -> dict:
        progress(f"[export] {role}: loading {source} ...")
        model_cfg, state, tokenizer = weights.load(source)
        if g.max_context > model_cfg.max_position_embeddings:
            raise ConfigError(f"graphs.max_context={g.max_context} exceeds the model's "
                              f"{model_cfg.max_position_embeddings} positions")
        if role == "target" and g.layer_skip_layers >= model_cfg.n_layers:
            raise ConfigError(f"graphs.layer_skip_layers={g.layer_skip_layers} must be below the "
                              f"model's {model_cfg.n_layers} layers")
        for i, (stem, spec) in enumerate(todo.items(), 1):
            progress(f"[export] {role}: graph {i}/{len(todo)} {stem} (width {spec['width']}) ...")
            export_graph(model_cfg, state, folder / f"{stem}.onnx", store, kind=spec["kind"], width=spec["width"],
                         max_context=g.max_context, dtype=g.dtype, n_layers=spec.get("n_layers"),
                         hidden_layers=tuple(spec.get("hidden_layers", ())))
        if fresh:
            weights.write_side_files(folder, model_cfg, tokenizer)
        return {"model": model_cfg.name}

    return ensure_graphs(Path(out_dir), identity, graphs, make, progress, f"[export] {role}")


class WeightStore:
    """One file holding each distinct large initializer once; graphs reference it by offset. append:
    open an existing store (its index, weights.index.json beside it, says what it holds) and add to
    its end, leaving the bytes already there, and the sessions mapping them, untouched."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.index_path = self.path.with_name(self.path.stem + ".index.json")
        self.offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
        if append:
            self.offsets = {key: tuple(value) for key, value in json.loads(self.index_path.read_text()).items()}
            self.fh = self.path.open("ab")
            self.size = self.path.stat().st_size
        else:
            self.fh = self.path.open("wb")
            self.size = 0

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
        folders.write_atomic(self.index_path, json.dumps(self.offsets))


def ensure_graphs(out: Path, identity: dict, graphs: dict[str, dict], make: MakeGraphs, progress: Progress = print,
                  label: str = "[graphs]") -> Path:
    """The graph folder out holding every graph of `graphs` (stem -> spec) made for `identity` (what all
    its graphs depend on: the checkpoint or source folder's stamp, a pass's format ...). Writers hold
    out's lock (folders.writing: concurrent makers, a CLI and a node, wait for each other; what a killed
    one left is undone first); a reader never sees a part:
      - every graph there with the same spec: nothing runs (the folder's last use is noted);
      - the same identity: make() adds only the missing graphs (or those whose spec changed), each file
        renamed into place, appending to weights.bin past every blob its index lists; the manifest,
        written last and atomically, then lists them (killed before that, the folder is as it was);
      - else (a new folder, a new identity, a folder of an older format): make() writes every graph into
        a temporary folder that then replaces out (folders.publish).
    Graphs out holds that `graphs` does not name are left alone: their readers ask for them by stem."""

    def state() -> tuple[str, dict, dict]:
        path = out / "manifest.json"
        try:
            have = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError:
            have = {}
        if not have or any(have.get(key) != value for key, value in identity.items()) \
                or not (out / "weights.index.json").is_file():
            return "fresh", have, dict(graphs)
        todo = {stem: spec for stem, spec in graphs.items()
                if have.get("graphs", {}).get(stem) != spec or not (out / f"{stem}.onnx").is_file()}
        return ("current" if not todo else "extend"), have, todo

    if state()[0] == "current":
        folders.mark_used(out)
        return out
    with folders.writing(out, progress, label):
        kind, have, todo = state()
        if kind == "current":
            folders.mark_used(out)
            return out
        started = time.monotonic()
        fresh = kind == "fresh"
        folder = folders.temporary(out) if fresh else out
        if fresh:
            have = {}
        store = WeightStore(folder / "weights.bin", append=not fresh)
        try:
            extra = make(todo, folder, store, fresh)
        finally:
            store.close()
        made = list(have.get("made", [])) + [{"graphs": list(todo), "seconds": round(time.monotonic() - started, 1)}]
        manifest = dict(identity, **extra, graphs=dict(have.get("graphs", {}), **todo), made=made)
        folders.write_atomic(folder / "manifest.json", json.dumps(manifest, indent=1))
        if fresh:
            folders.publish(folder, out)
        folders.mark_used(out)
    progress(f"{label} {len(todo)} graph{'' if len(todo) == 1 else 's'} "
             f"{'made' if fresh else 'added'} in {made[-1]['seconds']} s ({out})")
    return out


def export_graph(model_cfg: ModelConfig, state: dict, path: Path, store: WeightStore, *, kind: str,
                 width: int, max_context: int, dtype: str = "float32", n_layers: int | None = None,
                 hidden_layers: tuple[int, ...] = ()) -> None:
    """Export one static graph to path, its large weights moved into store."""
    import torch

    from spec_edge.graphs import model as model_mod

    layers = n_layers or model_cfg.n_layers
    images = kind == "prefill_image"  # a vision model's prefill, with image rows (graphs/vision.py)
    prefill = kind == "prefill" or images
    module = model_mod.build(model_cfg, state, n_layers=n_layers, dtype=torch_dtype(dtype),
                             hidden_layers=hidden_layers, cls=model_mod.LayerCaches)
    module.prefill, module.images = prefill, images
    k_cache, v_cache = model_mod.empty_cache(model_cfg, max_context, layers, dtype=torch_dtype(dtype))
    args = (torch.zeros(1, width, dtype=torch.int64), torch.tensor([0]))
    if prefill:
        args = args + (torch.tensor([width - 1]),)
    if images:
        args = args + (torch.zeros(width, model_cfg.hidden_size), torch.zeros(width, dtype=torch.bool))
    args = args + tuple(layer.clone() for layer in (*k_cache, *v_cache))  # one (Hkv, S, D) input per layer
    outputs = list(io_names.GRAPH_OUTPUTS) + ([io_names.HIDDEN] if hidden_layers else [])
    save_static(module, args, io_names.graph_inputs(layers, prefill, images), outputs, path, store)


def save_static(module, args: tuple, inputs: list[str], outputs: list[str], path: Path, store: WeightStore) -> None:
    """Trace module into a static graph saved at path, its large weights moved into store."""
    graph = trace(module, args, inputs, outputs)
    check_static(graph, path.name)
    save(graph, path, store)


def trace(module, args: tuple, inputs: list[str], outputs: list[str]):
    """torch.onnx's dynamo exporter (opset 20), quietly, optimized by optimize_folding(); returns the
    ModelProto. (torch's own optimize=True runs the same passes plus onnxscript's pattern rewriter,
    none of whose rules matches these graphs, for over half of the export's time: test_export.py
    checks that both give the same graph.)"""
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
                program = torch.onnx.export(module, args, dynamo=True, opset_version=20, input_names=inputs,
                                            output_names=outputs, optimize=False, verbose=False)
        finally:
            quiet.setLevel(level)
        optimize_folding(program.model)
        program.save(str(tmp_path), external_data=True)
        return onnx.load(str(tmp_path), load_external_data=True)


def optimize_folding(model) -> None:
    """onnxscript.optimizer.optimize_ir's passes on an onnx_ir model, in place, without its pattern
    rewriter: functions inlined, constants folded (with shape inference) and unused nodes removed
    (twice at most), constants lifted to initializers, duplicates and common subexpressions merged."""
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript import optimizer

    class FoldConstants(ir.passes.InPlacePass):
        def call(self, model):
            return optimizer.fold_constants(model, onnx_shape_inference=True)

    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([FoldConstants(), common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(),
                               common.RemoveUnusedOpsetsPass()], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass())(model)


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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # a graph replaced in place is never seen half written
    onnx.save_model(graph, str(tmp))
    os.replace(tmp, path)


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


def head_side_files(folder: Path) -> tuple[str, ...]:
    """What a head folder holds besides its graphs, weights.bin and its index and manifest (head.json,
    draft_ids.npy, an own embedding): the files a post-export pass copies unchanged."""
    return tuple(sorted(path.name for path in Path(folder).iterdir()
                        if path.suffix in (".json", ".npy") and path.name not in ("manifest.json", "weights.index.json")))
