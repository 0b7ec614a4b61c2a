"""Fused attention for the ONNX Runtime backend (graphs.ort_attention = fused): the folder of fused
copies of an exported target / draft model / EAGLE-3 head, each graph rewritten by
graphs/gqa_rewrite.py. The exported graphs are untouched.

    <engine_dir>/<profile>/onnx/<folder>_fused/   the source's identity plus "attention": "fused"; its
                                                  graphs, plus the target's graphs of m > 1 rows
                                                  (plan.graph_plan), made from step_1 by rewrite_rows

Made graph by graph (export.ensure_graphs): graphs the plan adds later (more batch slots, a new k)
are added to the folder; a new export (a new identity) remakes it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.graphs import io_names, plan
from spec_edge.graphs.folders import folder_stamp
from spec_edge.graphs.gqa_rewrite import (FUSED_FORMAT, HEAD_LAYERS, AttentionRewriteError, Progress,
                                          rewrite_model, rewrite_rows, target_layers)


def for_config(cfg, src_dir: Path, progress: Progress = print, geometry: ModelConfig | None = None,
               graphs: dict[str, dict] | None = None) -> Path:
    """The graph folder to run for graphs.ort_attention: src_dir itself for graph; its fused copy
    for fused, except (with a note) for a model whose attention has q/k norms, which the rewrite
    does not cover. src_dir: an exported target, draft model or EAGLE-3 head folder; geometry: a
    head folder's attention geometry (heads.eagle3.HeadConfig.as_model_config; a target or draft
    folder carries its own model.json); graphs: the stems (-> specs) to have, default all of src_dir's
    (a target: plan.graph_plan, whose graphs of m > 1 rows run with fused attention only)."""
    rows = sorted({spec["rows"] for spec in (graphs or {}).values() if spec.get("rows", 1) > 1})
    if cfg.graphs.ort_attention != "fused":
        if rows:
            raise ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs fused attention (each call binds "
                              f"any subset of the slots' cache regions to its rows); set graphs.ort_attention: fused, "
                              f"or graphs.batch_slots: 1 to run graphs.ort_attention: {cfg.graphs.ort_attention}")
        return src_dir
    if not plan.runs_fused(cfg, src_dir):
        if rows:
            raise ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs fused attention, which does not "
                              f"cover this model's q/k norms (Qwen3): set graphs.batch_slots: 1")
        progress("[fused] this model has q/k norms, which fused attention does not cover: running the exported "
                 "attention (set graphs.ort_attention: graph to silence this)")
        return src_dir
    return ensure_fused(src_dir, progress, geometry, graphs)


def ensure_fused(src_dir: Path, progress: Progress = print, geometry: ModelConfig | None = None,
                 graphs: dict[str, dict] | None = None) -> Path:
    """The fused-attention copy of an exported target / draft model / EAGLE-3 head folder (geometry:
    the head's attention geometry, as in for_config), holding `graphs` (stem -> spec; default: all of
    src_dir's graphs). A graph of m > 1 rows is made from the source's step_1 (the layer-skip one from
    its layer-skip graph), at its width."""
    from spec_edge.graphs.export import ensure_graphs

    src_dir = Path(src_dir)
    manifest = json.loads((src_dir / "manifest.json").read_text())
    role = manifest.get("role")
    if role in ("target", "draft"):
        model_cfg = plan.read_model_config(src_dir)
        widest = int(manifest["prefill_chunk"])  # the only padded graph
        copies = ("model.json", "tokenizer.json", "tokenizer_config.json")
    elif role == "eagle3":  # the head's ingest graphs are padded up to their width
        if geometry is None:
            raise AttentionRewriteError(f"{src_dir}: fusing a head's attention needs the head's geometry "
                                        f"(heads.eagle3_layouts.read_head_config(folder).as_model_config())")
        model_cfg = geometry
        widest = max(int(spec["width"]) for spec in manifest["graphs"].values())
        copies = None
    else:
        raise AttentionRewriteError(f"{src_dir}: fused attention applies to target, draft model and EAGLE-3 head "
                                    f"graphs, not {role}")
    cache_rows = int(manifest["max_context"]) + widest  # room for a padded call's padding rows
    graphs = dict(manifest["graphs"]) if graphs is None else graphs
    identity = {key: value for key, value in manifest.items() if key not in ("graphs", "made")}
    identity.update(attention="fused", fused_format=FUSED_FORMAT, cache_rows=cache_rows,
                    fused_source_stamp=folder_stamp(src_dir))

    def source_of(stem: str, spec: dict) -> str:
        if spec.get("rows", 1) == 1:
            return stem
        base = f"layerskip{spec['n_layers']}_step" if spec["kind"] == "layerskip" else "step"
        return io_names.graph_file(base, 1)

    missing = sorted({source_of(stem, spec) for stem, spec in graphs.items()} - set(manifest["graphs"]))
    if missing:
        raise AttentionRewriteError(f"{src_dir} lacks the exported graphs {missing}: re-run `spec-edge export`")

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        import onnx

        from spec_edge.graphs import export

        progress(f"[fused] rewriting attention into GroupQueryAttention ({src_dir.name} -> {folder.name}, "
                 f"{len(todo)} graphs) ...")
        for stem, spec in todo.items():
            source = source_of(stem, spec)
            if manifest["graphs"][source].get("hidden_layers") != spec.get("hidden_layers"):
                raise AttentionRewriteError(f"{src_dir / source}.onnx returns other hidden states than {stem} "
                                            f"needs: re-run `spec-edge export`")
            model = onnx.load(str(src_dir / f"{source}.onnx"), load_external_data=True)
            layers = HEAD_LAYERS if role == "eagle3" else target_layers(int(spec.get("n_layers", model_cfg.n_layers)))
            if spec.get("rows", 1) > 1:
                rewrite_rows(model, model_cfg, layers, int(spec["width"]), cache_rows, int(spec["rows"]))
            else:
                rewrite_model(model, model_cfg, layers, int(spec["width"]), cache_rows)
            export.save(model, folder / f"{stem}.onnx", store)
            progress(f"[fused]   {stem}: {len(layers)} layers")
        if fresh:
            for name in copies or export.head_side_files(src_dir):
                shutil.copy2(src_dir / name, folder / name)
        return {}

    return ensure_graphs(plan.fused_dir(src_dir), identity, graphs, make, progress, "[fused]")
