"""Fused attention for the ONNX Runtime backend (graphs.ort_attention = fused): the folder of fused
copies of an exported target / draft model / EAGLE-3 head, each graph rewritten by
graphs/gqa_rewrite.py (the (B, T) graphs of graphs/batch_export.py by graphs/batch_attention.py).
The exported graphs are untouched.

    <engine_dir>/<profile>/onnx/<folder>_fused/   same stems and manifest, plus "attention": "fused"
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from spec_edge.config import ModelConfig
from spec_edge.graphs.batch_attention import rewrite_batch
from spec_edge.graphs.gqa_rewrite import (FUSED_FORMAT, HEAD_LAYERS, AttentionRewriteError, Progress,
                                          rewrite_model, target_layers)


# ---------------------------------------------------------------------------------------------
# The artifact folder


def fused_dir(src_dir: Path) -> Path:
    return src_dir.parent / f"{src_dir.name}_fused"


def for_config(cfg, src_dir: Path, progress: Progress = print, geometry: ModelConfig | None = None) -> Path:
    """The graph folder to run for graphs.ort_attention: src_dir itself for graph; its fused copy
    for fused, except (with a note) for a model whose attention has q/k norms, which the rewrite
    does not cover. src_dir: an exported target, draft model or EAGLE-3 head folder; geometry: a
    head folder's attention geometry (heads.eagle3.HeadConfig.as_model_config; a target or draft
    folder carries its own model.json)."""
    from spec_edge.graphs.export import read_model_config

    if cfg.graphs.ort_attention != "fused":
        return src_dir
    role = json.loads((Path(src_dir) / "manifest.json").read_text()).get("role")
    if role in ("target", "draft") and read_model_config(src_dir).qk_norm:
        progress("[fused] this model has q/k norms, which fused attention does not cover: running the exported "
                 "attention (set graphs.ort_attention: graph to silence this)")
        return src_dir
    return ensure_fused(src_dir, progress, geometry)


def ensure_fused(src_dir: Path, progress: Progress = print, geometry: ModelConfig | None = None) -> Path:
    """The fused-attention copy of an exported target / draft model / EAGLE-3 head folder (geometry:
    the head's attention geometry, as in for_config); made once, redone when the source folder
    changes."""
    from spec_edge.graphs.export import ensure_derived, source_stamp

    src_dir = Path(src_dir)
    stamp = source_stamp(src_dir)
    return ensure_derived(fused_dir(src_dir), {"fused_source_stamp": stamp, "fused_format": FUSED_FORMAT},
                          lambda tmp: _convert(src_dir, tmp, stamp, progress, geometry))


def _convert(src: Path, dst: Path, stamp: str, progress: Progress, geometry: ModelConfig | None) -> None:
    import onnx

    from spec_edge.graphs import export
    from spec_edge.graphs.export import WeightStore, read_model_config

    started = time.monotonic()
    progress(f"[fused] rewriting attention into GroupQueryAttention ({src.name} -> {dst.name}) ...")
    manifest = json.loads((src / "manifest.json").read_text())
    role = manifest.get("role")
    if role in ("target", "draft"):
        model_cfg = read_model_config(src)
        widest = int(manifest["prefill_chunk"])  # the only padded graph
        copies = ("model.json", "tokenizer.json", "tokenizer_config.json")
    elif role == "eagle3":  # the head's ingest graphs are padded up to their width
        if geometry is None:
            raise AttentionRewriteError(f"{src}: fusing a head's attention needs the head's geometry "
                                        f"(heads.eagle3_export.read_head_config(folder).as_model_config())")
        model_cfg = geometry
        widest = max(int(spec["width"]) for spec in manifest["graphs"].values())
        copies = export.head_side_files(src)
    else:
        raise AttentionRewriteError(f"{src}: fused attention applies to target, draft model and EAGLE-3 head "
                                    f"graphs, not {role}")
    cache_rows = int(manifest["max_context"]) + widest  # room for a padded call's padding rows
    dst.mkdir(parents=True)
    store = WeightStore(dst / "weights.bin")
    for stem, spec in manifest["graphs"].items():
        model = onnx.load(str(src / f"{stem}.onnx"), load_external_data=True)
        layers = HEAD_LAYERS if role == "eagle3" else target_layers(int(spec.get("n_layers", model_cfg.n_layers)))
        if int(spec.get("batch", 1)) > 1:  # a (B, T) graph of graphs/batch_export.py
            rewrite_batch(model, model_cfg, layers, int(spec["width"]), cache_rows, int(spec["batch"]))
        else:
            rewrite_model(model, model_cfg, layers, int(spec["width"]), cache_rows)
        export.save(model, dst / f"{stem}.onnx", store)
        progress(f"[fused]   {stem}: {len(layers)} layers")
    store.close()
    for name in copies:
        shutil.copy2(src / name, dst / name)
    seconds = round(time.monotonic() - started, 1)
    manifest.update(attention="fused", fused_format=FUSED_FORMAT, cache_rows=cache_rows, fused_source_stamp=stamp,
                    weights_bytes=store.size, fused_seconds=seconds)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[fused] ready in {seconds} s (made once; reused until the export changes)")
