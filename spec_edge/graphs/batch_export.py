"""ONNX export of the batched target graphs (graphs.batch_slots = B > 1), in their own folder.

    <engine_dir>/<profile>/onnx/target_b<B>/     never the B=1 folder target/ (other users read it)
      manifest.json    export.py's keys plus "batch_slots": B and "row_counts"; each batched graph's
                       spec has "batch": m, its row count
      prefill_<C>.onnx (1, C): the B=1 prefill graph, bound to one slot's region of the cache
      rows<m>_step_1.onnx     (m, 1)     graphs/batch_model.py: tokens (m, T), position (m,),
      rows<m>_step_2.onnx     (m, 2)     (the two-row step of q4)
      rows<m>_verify_<k+1>.onnx (m, k+1) caches (m, Hkv, S, D) per layer -> logits (m, T, V), k/v_new
      single_step_1.onnx, single_verify_<k+1>.onnx   the B=1 graphs: a call with one row
    A profile with draft heads (hidden.target_hidden_layers: speculative.eagle3_head / peagle_head /
    medusa_head set) also gets the hidden-state output of export.py's graphs on every graph here
    (spec "hidden_layers"; the batched graphs' is (m, T, n * H)), which the per-slot heads read
    (runtime/backends/ort_batch.py keeps it per slot).

A call runs only the slots it names (runtime/backends/ort_batch.py): n rows go through the graph of
the smallest row count m >= n (row_counts: every count up to 8, then coarser), the m - n padding rows
bound to a scratch region. The post-export passes run on the folder as on target/ and land beside it
(target_b<B>_fused/, target_b<B>_fused_q4/): batch_attention.py gives each row of each layer its own
GroupQueryAttention node and cache input (any slot's region can be bound to any row), quantize.py the
GGUF's Q4_1 blocks (no two-row step: a batched call multiplies M = m*T > 1 rows). Batched graphs run
with fused attention only (batch_graphs refuses graphs.ort_attention: graph); the unfused export
here is the rewrite's source (and what test_batch checks against torch).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from spec_edge.config import Config, ConfigError, engine_root
from spec_edge.graphs import export, hidden, io_names

Progress = Callable[[str], None]


SINGLE = "single_"  # stem prefix of the B=1 graphs in the batched folder
BATCH_FORMAT = 2  # 2: graphs per row count m (calls over any subset of slots); bumped when the layout changes


def row_counts(batch: int) -> tuple[int, ...]:
    """Row counts m of the batched graphs for B slots (one row runs the B=1 graphs): every count up to
    8, then steps of 2 up to 16, of 4 up to 32, of 8 up to 64, and B. A call with n rows runs the
    smallest m >= n, so its padding rows are under a quarter of its rows. Measured on this CPU
    (docs/bench.md, "Calls over a subset of the slots"): a batched call costs about in proportion to
    its rows (fp32 verify +6-8 ms a row, q4 +14-25 ms), so padding to powers of two would cost up to
    37% (fp32) / 44% (q4) more at 5 of 8 slots; each count is one session per width (fp32: 0.54 GB)."""
    counts, m = [], 2
    while m < batch:
        counts.append(m)
        m += 1 << max(0, m.bit_length() - 3)  # 1 below 8, then a quarter of the power of two below m
    return tuple(counts + [batch])


def rows_stem(rows: int, kind: str, width: int) -> str:
    """File stem of a batched graph: rows_stem(4, "verify", 5) = 'rows4_verify_5'."""
    return f"rows{rows}_" + io_names.graph_file(kind, width)


def batch_dir(cfg: Config) -> Path:
    return engine_root(cfg) / cfg.runtime.profile / "onnx" / f"target_b{cfg.graphs.batch_slots}"


def batch_plan(cfg: Config, rows: tuple[int, ...] | None = None) -> dict[str, dict]:
    """stem -> spec of the batched folder: the B=1 prefill chunk, then per row count m (rows, default
    row_counts(B)) the (m, 1) step, the (m, 2) two-row step and an (m, k+1) verify per k."""
    g = cfg.graphs
    plan = {io_names.graph_file("prefill", g.prefill_chunk): {"kind": "prefill", "width": g.prefill_chunk}}
    for m in rows or row_counts(g.batch_slots):
        plan[rows_stem(m, "step", 1)] = {"kind": "step", "width": 1, "batch": m}
        # the two-row step of graphs.weights q4 (int8 activations: a one-row call's numerics differ, as
        # for B=1, graphs/two_rows.py): the pending token twice, row 0 read (runtime/speculative.py)
        plan[rows_stem(m, "step", 2)] = {"kind": "step", "width": 2, "batch": m}
        for k in sorted(set(g.k_values) - {1}):
            plan[rows_stem(m, "verify", k + 1)] = {"kind": "verify", "width": k + 1, "batch": m}
    # the B=1 step and verify graphs (the same as export.py's), bound to one slot: one occupied slot
    # runs at the single-request speed, its rows equal to the batched graphs' (test/test_batch.py)
    plan[SINGLE + io_names.graph_file("step", 1)] = {"kind": "step", "width": 1}
    for k in sorted(set(g.k_values)):
        plan[SINGLE + io_names.graph_file("verify", k + 1)] = {"kind": "verify", "width": k + 1}
    hidden_layers = hidden.target_hidden_layers(cfg)
    if hidden_layers:  # draft heads are configured: every graph also returns the hidden states they read
        for spec in plan.values():
            spec["hidden_layers"] = list(hidden_layers)
    return plan


def wanted(cfg: Config, fingerprint: str, rows: tuple[int, ...] | None = None) -> dict:
    g = cfg.graphs
    rows = tuple(rows or row_counts(g.batch_slots))
    return {"format": export.FORMAT_VERSION, "batch_format": BATCH_FORMAT, "role": "target",
            "source": cfg.model.target, "fingerprint": fingerprint, "max_context": g.max_context,
            "prefill_chunk": g.prefill_chunk, "dtype": g.dtype, "batch_slots": g.batch_slots,
            "row_counts": list(rows), "graphs": batch_plan(cfg, rows)}


def export_batch(cfg: Config, progress: Progress = print, rows: tuple[int, ...] | None = None) -> Path:
    """The exported batched folder of cfg's target (made once under a lock, redone when the
    checkpoint or a shape changes). rows: the row counts to export (default row_counts(B); a
    benchmark measuring other counts passes its own and its own runtime.profile)."""
    from spec_edge.graphs import weights

    if cfg.graphs.batch_slots < 2:
        raise ConfigError("graphs.batch_slots=1 runs the B=1 graphs (export.py); batched graphs need B >= 2")
    if rows is not None and (min(rows) < 2 or max(rows) != cfg.graphs.batch_slots):
        raise ConfigError(f"batched row counts must lie in [2, B] and include B={cfg.graphs.batch_slots}, got {rows}")
    fingerprint = weights.fingerprint(cfg.model.target)
    want = wanted(cfg, fingerprint, rows)
    out = batch_dir(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export.ensure_derived(out, want, lambda tmp: _export_into(cfg, want, tmp, progress))


def _export_into(cfg: Config, want: dict, out_dir: Path, progress: Progress) -> None:
    from spec_edge.graphs import weights

    started = time.monotonic()
    g = cfg.graphs
    progress(f"[export] batched target (B={g.batch_slots}): loading {cfg.model.target} ...")
    model_cfg, state, tokenizer, store = export.load_into(cfg, cfg.model.target, out_dir)
    for i, (stem, spec) in enumerate(want["graphs"].items(), 1):
        progress(f"[export] batched target: graph {i}/{len(want['graphs'])} {stem} ({spec.get('batch', 1)} rows, "
                 f"width {spec['width']}) ...")
        path = out_dir / f"{stem}.onnx"
        hidden_layers = tuple(spec.get("hidden_layers", ()))
        if "batch" not in spec:  # a B=1 graph, as export.py writes it
            export.export_graph(model_cfg, state, path, store, kind=spec["kind"], width=spec["width"],
                                max_context=g.max_context, dtype=g.dtype, hidden_layers=hidden_layers)
        else:
            export_batch_graph(model_cfg, state, path, store, batch=spec["batch"], width=spec["width"],
                               max_context=g.max_context, dtype=g.dtype, hidden_layers=hidden_layers)
    store.close()
    weights.write_side_files(out_dir, model_cfg, tokenizer)
    manifest = dict(want, model=model_cfg.name, weights_bytes=store.size,
                    export_seconds=round(time.monotonic() - started, 1))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[export] batched target: {len(want['graphs'])} graphs in {manifest['export_seconds']} s")


def export_batch_graph(model_cfg, state: dict, path: Path, store: export.WeightStore, *, batch: int, width: int,
                       max_context: int, dtype: str = "float32", hidden_layers: tuple[int, ...] = ()) -> None:
    """Export one (m, T) graph of batch_model.BatchCaches (batch = its row count m) to path, every tensor
    static; hidden_layers: also return those layers' hidden states (m, T, n * H) (graphs/hidden.py)."""
    import torch

    from spec_edge.graphs import model as model_mod
    from spec_edge.graphs.batch_model import BatchCaches

    torch_dtype = export.torch_dtype(dtype)
    module = model_mod.build(model_cfg, state, dtype=torch_dtype, hidden_layers=hidden_layers, cls=BatchCaches)
    layer = (batch, model_cfg.n_kv_heads, max_context, model_cfg.head_dim)  # (m, Hkv, S, D)
    caches = tuple(torch.zeros(layer, dtype=torch_dtype) for _ in range(2 * model_cfg.n_layers))
    args = (torch.zeros(batch, width, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)) + caches
    outputs = list(io_names.GRAPH_OUTPUTS) + ([io_names.HIDDEN] if hidden_layers else [])
    export.save_static(module, args, io_names.graph_inputs(model_cfg.n_layers), outputs, path, store)


def batch_graphs(cfg: Config, progress: Progress = print, rows: tuple[int, ...] | None = None) -> Path:
    """The folder ONNX Runtime runs for graphs.batch_slots > 1: the batched export with the passes the
    config asks for (fused attention, which a call over a subset of the slots needs; graphs.weights
    q4 / q4_fp32act: the GGUF's 4-bit blocks). rows: as export_batch."""
    from spec_edge.graphs import ort_attention, quantize

    if cfg.runtime.backend != "onnxruntime":
        raise ConfigError("the batched ONNX Runtime graphs are for runtime.backend=onnxruntime; TensorRT batches "
                          "inside the engines `spec-edge build` writes")
    if cfg.graphs.ort_attention != "fused":
        raise ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs fused attention (each call binds any "
                          f"subset of the slots' cache regions to its rows); set graphs.ort_attention: fused, or "
                          f"graphs.batch_slots: 1 to run graphs.ort_attention: {cfg.graphs.ort_attention}")
    exported = export_batch(cfg, progress, rows)
    if export.read_model_config(exported).qk_norm:
        raise ConfigError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs fused attention, which does not cover "
                          f"this model's q/k norms (Qwen3): set graphs.batch_slots: 1")
    graph_dir = ort_attention.ensure_fused(exported, progress)
    if cfg.graphs.weights != "fp32":
        graph_dir = quantize.for_config(cfg, graph_dir, progress)
    return graph_dir

