"""ONNX export of the batched target graphs (graphs.batch_slots = B > 1), in their own folder.

    <engine_dir>/<profile>/onnx/target_b<B>/     never the B=1 folder target/ (other users read it)
      manifest.json    export.py's keys plus "batch_slots": B; each batched graph's spec has "batch": B
      prefill_<C>.onnx (1, C): the B=1 prefill graph, bound to one slot's region of the cache
      step_1.onnx      (B, 1)        graphs/batch_model.py: tokens (B, T), position (B,),
      step_2.onnx      (B, 2)        (the two-row step of q4)
      verify_<k+1>.onnx (B, k+1)     caches (B, Hkv, S, D) per layer -> logits (B, T, V), k/v_new
      single_step_1.onnx, single_verify_<k+1>.onnx   the B=1 graphs, run when one slot is occupied

The post-export passes run on it as on target/ and land beside it (target_b<B>_fused/,
target_b<B>_fused_q4/): ort_attention.py gives each layer one GroupQueryAttention over
(B, Hkv, S + C, D) with per-slot seqlens_k, quantize.py the GGUF's Q4_1 blocks (no two-row step:
a batched call always multiplies M = B*T > 1 rows).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from spec_edge.config import QDQ_WEIGHTS, Config, ConfigError, engine_root
from spec_edge.graphs import export, io_names

Progress = Callable[[str], None]


SINGLE = "single_"  # stem prefix of the B=1 graphs in the batched folder


def batch_dir(cfg: Config) -> Path:
    return engine_root(cfg) / cfg.runtime.profile / "onnx" / f"target_b{cfg.graphs.batch_slots}"


def batch_plan(cfg: Config) -> dict[str, dict]:
    """stem -> spec of the batched folder: the B=1 prefill chunk, the (B, 1) step, a (B, k+1) verify per k."""
    g = cfg.graphs
    batch = g.batch_slots
    plan = {io_names.graph_file("prefill", g.prefill_chunk): {"kind": "prefill", "width": g.prefill_chunk},
            io_names.graph_file("step", 1): {"kind": "step", "width": 1, "batch": batch},
            # the two-row step of graphs.weights q4 (int8 activations: a one-row call's numerics differ, as
            # for B=1, graphs/two_rows.py): the pending token twice, row 0 read (runtime/batch.py)
            io_names.graph_file("step", 2): {"kind": "step", "width": 2, "batch": batch}}
    for k in sorted(set(g.k_values) - {1}):
        plan[io_names.graph_file("verify", k + 1)] = {"kind": "verify", "width": k + 1, "batch": batch}
    # the B=1 step and verify graphs (the same as export.py's), bound to one slot: one occupied slot
    # runs at the single-request speed, its rows equal to the batched graphs' (bench/batch_invariance.py)
    plan[SINGLE + io_names.graph_file("step", 1)] = {"kind": "step", "width": 1}
    for k in sorted(set(g.k_values)):
        plan[SINGLE + io_names.graph_file("verify", k + 1)] = {"kind": "verify", "width": k + 1}
    return plan


def wanted(cfg: Config, fingerprint: str) -> dict:
    g = cfg.graphs
    return {"format": export.FORMAT_VERSION, "role": "target", "source": cfg.model.target, "fingerprint": fingerprint,
            "max_context": g.max_context, "prefill_chunk": g.prefill_chunk, "dtype": g.dtype, "layout": "static",
            "batch_slots": g.batch_slots, "graphs": batch_plan(cfg)}


def export_batch(cfg: Config, progress: Progress = print) -> Path:
    """The exported batched folder of cfg's target (made once under a lock, redone when the
    checkpoint or a shape changes)."""
    from spec_edge.graphs import weights

    if cfg.graphs.batch_slots < 2:
        raise ConfigError("graphs.batch_slots=1 runs the B=1 graphs (export.py); batched graphs need B >= 2")
    fingerprint = weights.fingerprint(cfg.model.target)
    want = wanted(cfg, fingerprint)
    out = batch_dir(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export.ensure_derived(out, want, lambda tmp: _export_into(cfg, want, tmp, progress))


def _export_into(cfg: Config, want: dict, out_dir: Path, progress: Progress) -> None:
    from spec_edge.graphs import weights

    started = time.monotonic()
    g = cfg.graphs
    progress(f"[export] batched target (B={g.batch_slots}): loading {cfg.model.target} ...")
    model_cfg, state, tokenizer = weights.load(cfg.model.target)
    if g.max_context > model_cfg.max_position_embeddings:
        raise ConfigError(f"graphs.max_context={g.max_context} exceeds the model's "
                          f"{model_cfg.max_position_embeddings} positions")
    out_dir.mkdir(parents=True)
    store = export.WeightStore(out_dir / "weights.bin")
    for i, (stem, spec) in enumerate(want["graphs"].items(), 1):
        progress(f"[export] batched target: graph {i}/{len(want['graphs'])} {stem} (B={spec.get('batch', 1)}, "
                 f"width {spec['width']}) ...")
        path = out_dir / f"{stem}.onnx"
        if "batch" not in spec:  # a B=1 graph, as export.py writes it
            export.export_graph(model_cfg, state, path, store, kind=spec["kind"], width=spec["width"],
                                max_context=g.max_context, dtype=g.dtype)
        else:
            export_batch_graph(model_cfg, state, path, store, batch=spec["batch"], width=spec["width"],
                               max_context=g.max_context, dtype=g.dtype)
    store.close()
    weights.write_side_files(out_dir, model_cfg, tokenizer)
    manifest = dict(want, model=model_cfg.name, weights_bytes=store.size,
                    export_seconds=round(time.monotonic() - started, 1))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[export] batched target: {len(want['graphs'])} graphs in {manifest['export_seconds']} s")


def export_batch_graph(model_cfg, state: dict, path: Path, store: export.WeightStore, *, batch: int, width: int,
                       max_context: int, dtype: str = "float32") -> None:
    """Export one (B, T) graph of batch_model.BatchCaches to path, every tensor static."""
    import torch

    from spec_edge.graphs import model as model_mod
    from spec_edge.graphs.batch_model import BatchCaches

    torch_dtype = export.torch_dtype(dtype)
    module = model_mod.build(model_cfg, state, dtype=torch_dtype, cls=BatchCaches)
    layer = (batch, model_cfg.n_kv_heads, max_context, model_cfg.head_dim)  # (B, Hkv, S, D)
    caches = tuple(torch.zeros(layer, dtype=torch_dtype) for _ in range(2 * model_cfg.n_layers))
    args = (torch.zeros(batch, width, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)) + caches
    graph = export.trace(module, args, io_names.graph_inputs(model_cfg.n_layers), list(io_names.GRAPH_OUTPUTS))
    export.check_static(graph, path.name)
    export.save(graph, path, store)


def batch_graphs(cfg: Config, progress: Progress = print) -> Path:
    """The folder ONNX Runtime runs for graphs.batch_slots > 1: the batched export with the passes the
    config asks for (fused attention; graphs.weights q4 / q4_fp32act: the GGUF's 4-bit blocks)."""
    from spec_edge.graphs import ort_attention, quantize

    if cfg.runtime.backend != "onnxruntime":
        raise ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs on runtime.backend=onnxruntime; "
                          f"TensorRT engines with a batch axis are not built yet (set graphs.batch_slots: 1)")
    if cfg.graphs.weights in QDQ_WEIGHTS:
        raise ConfigError(f"graphs.batch_slots > 1 runs graphs.weights fp32, q4 or q4_fp32act, not "
                          f"{cfg.graphs.weights}")
    graph_dir = ort_attention.for_config(cfg, export_batch(cfg, progress), progress)
    if cfg.graphs.weights != "fp32":
        graph_dir = quantize.for_config(cfg, graph_dir, progress)
    return graph_dir

