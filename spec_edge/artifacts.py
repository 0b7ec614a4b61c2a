"""Build before serve: every command that serves (spec-edge generate / serve / bench, the node on
configure) loads through engine(cfg): ensure(cfg) makes what is missing, then runtime/decoders.open_decoder(cfg) only loads
(runtime/ makes no file and refuses a missing one with `spec-edge export`, which runs ensure(cfg) too).

ONNX Runtime, each model and head the profile names, into plan.ort_dir, each step graph by graph and only
where missing (export.ensure_graphs: a later start makes nothing):
    target, draft (model.draft)   export -> fused attention -> the target's q4 copy (graphs.weights) -> packed
    vision (a vision target)      its encoder graph (graphs/vision.py), run as exported
    eagle3, peagle, medusa        the head's export -> fused attention (EAGLE-3) -> its q8 copy -> packed
TensorRT Edge-LLM: `spec-edge build` (device/) builds on the device; nothing is made here.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spec_edge.config import Config
from spec_edge.graphs import export, ort_attention, plan, quantize
from spec_edge.runtime.backends import onnxruntime
from spec_edge.runtime.backends.base import BackendError

if TYPE_CHECKING:
    from spec_edge.runtime.serving import Decoder

Progress = Callable[[str], None]
PACKED_DATA = "weights.bin"
_PREPACKED = "prepacked"  # external-data keys "prepacked_<n>": "<kernel key>|offset;length;checksum[|...]"
HEADS = ("eagle3", "peagle", "medusa")


def engine(cfg: Config, progress: Progress = print) -> Decoder:
    """The engine of cfg (a runtime.serving.Decoder), its files made first where missing."""
    from spec_edge.runtime.decoders import open_decoder

    ensure(cfg, progress)
    return open_decoder(cfg, progress)


def ensure(cfg: Config, progress: Progress = print) -> dict[str, Path]:
    """Make what cfg serves from where it is missing (module docstring); role -> the folder ONNX Runtime runs
    ({} on tensorrt)."""
    if cfg.runtime.backend == "remote" and cfg.remote.fallback == "local":  # the fallback's graphs
        cfg = cfg.replace(**{"runtime.backend": "onnxruntime"})
    if cfg.runtime.backend != "onnxruntime":
        return {}
    progress(f"[engine] artifacts of profile '{cfg.runtime.profile}': {plan.artifact_dir(cfg, 'target').parent.parent} "
             f"(runtime.engine_dir: {cfg.runtime.engine_dir})")
    roles = ["target"] + (["draft"] if cfg.model.draft else [])
    made = {role: model_graphs(cfg, role, progress) for role in roles}
    if plan.is_vision(cfg.model.target):  # its encoder graph beside the text graphs
        from spec_edge.graphs.vision import ensure_vision

        made["vision"] = ensure_vision(cfg, progress)
    target = plan.read_model_config(plan.artifact_dir(cfg, "target"))
    made.update({kind: head_graphs(cfg, kind, target, progress) for kind in HEADS
                 if getattr(cfg.speculative, f"{kind}_head")})
    return made


def model_graphs(cfg: Config, role: str, progress: Progress = print) -> Path:
    """The folder ONNX Runtime runs for cfg's target or draft model (exported first where missing, then
    ort_graphs)."""
    return ort_graphs(cfg, role, export.export_model(cfg, role, plan.artifact_dir(cfg, role), progress), progress)


def ort_graphs(cfg: Config, role: str, exported: Path, progress: Progress) -> Path:
    """The folder ONNX Runtime runs for an exported target or draft model, holding the graphs of the
    config's plan (plan.graph_plan: with graphs.batch_slots > 1 the target's graphs of m > 1 rows
    too): the post-export passes the config asks for (fused attention, graphs/ort_attention.py; for
    the target with graphs.weights q4 / q4_fp32act also the GGUF's 4-bit blocks, graphs/quantize.py),
    then its packed copy (what its sessions load), each made graph by graph."""
    graphs = plan.graph_plan(cfg, role)
    graph_dir = ort_attention.for_config(cfg, exported, progress, graphs=graphs)
    if role == "target" and cfg.graphs.weights != "fp32":
        graph_dir = quantize.for_config(cfg, graph_dir, progress, graphs=graphs)
    ensure_packed(graph_dir, cfg.runtime.threads, progress, graphs)
    return graph_dir


def head_graphs(cfg: Config, kind: str, target, progress: Progress) -> Path:
    """The folder ONNX Runtime runs for the configured `kind` head (speculative.<kind>_head) of a target
    (its ModelConfig): exported into its artifact folder, its attention fused (EAGLE-3 heads), then
    graphs.head_weights' copy and its packed copy."""
    from spec_edge.heads import eagle3_layouts, export

    export_head = {"eagle3": export.export_eagle3, "peagle": export.export_peagle, "medusa": export.export_medusa}
    head_dir = export_head[kind](cfg, getattr(cfg.speculative, f"{kind}_head"), target, plan.artifact_dir(cfg, kind),
                                 progress)
    if kind == "eagle3":
        head_dir = ort_attention.for_config(cfg, head_dir, progress,
                                            eagle3_layouts.read_head_config(head_dir).as_model_config())
    head_dir = quantize.for_head(cfg, head_dir, progress)
    ensure_packed(head_dir, cfg.runtime.threads, progress)
    return head_dir


def ensure_packed(graph_dir: Path, threads: int = 0, progress: Progress = print,
                  graphs: dict[str, dict] | None = None) -> Path:
    """The packed copy of graph_dir (what its sessions load: runtime/backends/onnxruntime.py's docstring)
    holding `graphs` (stem -> spec; default all of graph_dir's): made graph by graph beside it (<name>_packed/,
    export.ensure_graphs: a graph added later is packed into the same weights.bin), remade when the folder's
    identity, onnxruntime or the CPU changes. threads: as cpu_session (the process's pool is made by its first
    session, this one's if it packs first)."""
    graph_dir = Path(graph_dir)
    have = json.loads((graph_dir / "manifest.json").read_text())["graphs"]
    graphs = dict(have) if graphs is None else graphs
    missing = sorted(set(graphs) - set(have))
    if missing:
        raise BackendError(f"{graph_dir} lacks the graphs {missing}: re-run `spec-edge export`")
    identity = onnxruntime.packed_identity(graph_dir)

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        progress(f"[packed] {graph_dir.name}: pre-packing the weights of {len(todo)} graphs once ({folder.name}) ...")
        for stem in todo:
            _pack(graph_dir, stem, folder, store, threads)
        return {}

    return export.ensure_graphs(onnxruntime.packed_dir(graph_dir), identity, graphs, make, progress, "[packed]")


def _pack(src: Path, stem: str, dst: Path, store, threads: int) -> None:
    """Write dst/<stem>.onnx: src's graph optimized by ONNX Runtime with its pre-packed weights saved
    (session.save_external_prepacked_constant_initializers), every blob moved into store by content."""
    import onnx
    import onnxruntime as ort

    optimized, data = dst / f"{stem}.optimized.onnx", dst / f"{stem}.optimized.data"
    options = onnxruntime.session_options(threads)
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
