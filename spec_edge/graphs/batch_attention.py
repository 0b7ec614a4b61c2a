"""Fused attention for the batched graphs (graphs/batch_model.py): ort_attention.py's rewrite with m rows.

Per layer, everything between the q/k/v projections (rows (m*T, .)) and the o projection becomes one
com.microsoft GroupQueryAttention node per row j, over that row's T tokens, with its own cache input
<k_cache_i>_s<j> (1, Hkv, R, D) (io_names.slot_name) and in-place output <k_present_i>_s<j>:

    q/k/v (m*T, X) -Reshape-> (m, T, X) -Split(axis 0)-> m x (1, T, X)       (3 Splits per layer)
    row j: GroupQueryAttention(q_j, k_j, v_j, k_cache_i_s<j>, v_cache_i_s<j>, seqlens_k_j, total_len_j,
                               cos, sin) -> (1, T, H*D), k_present_i_s<j>, v_present_i_s<j>
    Concat(axis 1) -> (1, m*T, H*D) -Reshape-> (m*T, H*D) -> o projection
    seqlens_k_j = position[j] + T - 1 (1,) int32, total_len_j = position[j] + T () int32

The caller binds row j's cache input and output to the region of whichever slot row j serves
(runtime/backends/ort_batch.py; padding rows: a scratch region), so one graph runs any subset of
the slots. Each node is exactly the B=1 graph's node for that slot (test/test_batch.py:
bit for bit). One node per row is also what ONNX Runtime's CPU kernel asks for T > 1 ("batch_size
must be 1 when sequence_length > 1 and past context is given"); for T = 1 one node over all rows
would need the rows' caches contiguous, i.e. always all B slots (the cost of the extra nodes per
row: docs/bench.md, "Calls over a subset of the slots").

R = S + C as in ort_attention.py: room for the B=1 prefill graph's padding rows.
"""
from __future__ import annotations

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.gqa_rewrite import MS_DOMAIN, AttentionRewriteError, LayerIO, prune_and_sort, rotary_tables


def rewrite_batch(model, model_cfg, layers: list[LayerIO], width: int, cache_rows: int, batch: int) -> None:
    """Rewrite, in place, the attention of one exported (m, T) graph of batch_model.BatchCaches
    (batch = its row count m)."""
    from onnx import TensorProto, helper, numpy_helper

    if model_cfg.qk_norm:
        raise AttentionRewriteError("fused attention does not cover q/k norms (this model has them): "
                                    "batched graphs need it, set graphs.batch_slots: 1")
    graph = model.graph
    gemms = {node.input[1]: node for node in graph.node if node.op_type == "Gemm" and len(node.input) >= 2}
    hkv, heads, dim = model_cfg.n_kv_heads, model_cfg.n_heads, model_cfg.head_dim
    rows = range(batch)
    cos, sin = rotary_tables(model_cfg, cache_rows)

    new_inits = [numpy_helper.from_array(np.asarray(value), name) for name, value in (
        ("fused_rotary_cos", cos), ("fused_rotary_sin", sin),
        ("fused_width_minus_1", np.array([width - 1], np.int32)), ("fused_width", np.array(width, np.int32)),
        ("fused_axis0", np.array([0], np.int64)), ("fused_out_shape", np.array([batch * width, heads * dim], np.int64)),
        ("fused_bt_shape", np.array([batch, width, -1], np.int64)), ("fused_row_split", np.ones(batch, np.int64)))]
    positions = [f"fused_position32_s{j}" for j in rows]  # (1,) each
    prelude = [helper.make_node("Cast", [io_names.POSITION], ["fused_position32"], name="fused_position32",
                                to=TensorProto.INT32),  # (m,)
               helper.make_node("Split", ["fused_position32", "fused_row_split"], positions, name="fused_position_rows",
                                axis=0)]
    for j in rows:
        prelude += [
            helper.make_node("Add", [positions[j], "fused_width_minus_1"], [f"fused_seqlens_k_s{j}"],
                             name=f"fused_seqlens_k_s{j}"),
            helper.make_node("Squeeze", [positions[j], "fused_axis0"], [f"fused_position_scalar_s{j}"],
                             name=f"fused_position_scalar_s{j}"),
            helper.make_node("Add", [f"fused_position_scalar_s{j}", "fused_width"], [f"fused_total_len_s{j}"],
                             name=f"fused_total_len_s{j}")]

    def proj(layer: LayerIO, name: str):
        weight = f"{layer.weights}.{name}_proj.weight"
        if weight not in gemms:
            raise AttentionRewriteError(f"no Gemm reads {weight}: not a batched spec_edge export (re-export)")
        return gemms[weight]

    attention, present, cache_inputs = [], [], []
    for i, layer in enumerate(layers):
        q, k, v, o = (proj(layer, name) for name in ("q", "k", "v", "o"))
        per_row = {}
        for role, node in zip("qkv", (q, k, v)):
            shaped, per_row[role] = f"fused_{role}_{i}", [f"fused_{role}_{i}_s{j}" for j in rows]
            attention += [helper.make_node("Reshape", [node.output[0], "fused_bt_shape"], [shaped],
                                           name=shaped),  # (m, T, X)
                          helper.make_node("Split", [shaped, "fused_row_split"], per_row[role], name=f"{shaped}_rows",
                                           axis=0)]  # m x (1, T, X)
        outs = []
        for j in rows:
            names = [io_names.slot_name(n, j) for n in (layer.k_cache, layer.v_cache, layer.k_present, layer.v_present)]
            attention.append(helper.make_node(
                "GroupQueryAttention", [per_row[role][j] for role in "qkv"] + names[:2] +
                [f"fused_seqlens_k_s{j}", f"fused_total_len_s{j}", "fused_rotary_cos", "fused_rotary_sin"],
                [f"fused_attn_{i}_s{j}"] + names[2:], name=f"fused_gqa_{i}_s{j}", domain=MS_DOMAIN,
                num_heads=heads, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=0))
            outs.append(f"fused_attn_{i}_s{j}")  # (1, T, H*D)
            cache_inputs += names[:2]
            present += names[2:]
        attention += [helper.make_node("Concat", outs, [f"fused_attn_{i}"], name=f"fused_attn_{i}", axis=1),
                      helper.make_node("Reshape", [f"fused_attn_{i}", "fused_out_shape"], [f"fused_attn2d_{i}"],
                                       name=f"fused_attn2d_{i}")]  # (m*T, H*D)
        o.input[0] = f"fused_attn2d_{i}"

    cache_shape = [1, hkv, cache_rows, dim]
    kept = [out for out in graph.output if out.name not in (io_names.K_NEW, io_names.V_NEW)]
    del graph.output[:]
    graph.output.extend(kept)
    graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_shape) for name in present)
    old_caches = {layer.k_cache for layer in layers} | {layer.v_cache for layer in layers}
    kept_inputs = [value for value in graph.input if value.name not in old_caches]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    graph.input.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_shape) for name in cache_inputs)
    prune_and_sort(model, prelude + list(graph.node) + attention, new_inits)
