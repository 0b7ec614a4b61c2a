"""Fused attention for the batched graphs (graphs/batch_model.py): ort_attention.py's rewrite with B slots.

Per layer, everything between the q/k/v projections (rows (B*T, .)) and the o projection becomes
com.microsoft GroupQueryAttention writing each slot's new rows into its region of the cache in place:

  width 1 (the step): one node over (B, 1, .) with per-slot seqlens_k = position + T - 1 (B,) and
      total_len = max(position) + T, caches k_cache_<i> (B, Hkv, R, D) bound to the whole layer;
  width > 1 (verify): ONNX Runtime's CPU kernel refuses batch > 1 with T > 1 new rows over a past
      ("batch_size must be 1 when sequence_length > 1 and past context is given"), so each slot gets
      its own node over its T rows (a Slice of the (B*T, .) rows) and its own cache inputs
      <k_cache_i>_s<b> (1, Hkv, R, D) (io_names.slot_name), bound to slot b's region; the B outputs
      are joined back into (B*T, H*D). Each such node is exactly the B=1 graph's node for that slot.

R = S + C as in ort_attention.py: an idle slot's row, at its own position, writes into spare rows.
"""
from __future__ import annotations

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.gqa_rewrite import MS_DOMAIN, AttentionRewriteError, LayerIO, prune_and_sort, rotary_tables


def rewrite_batch(model, model_cfg, layers: list[LayerIO], width: int, cache_rows: int, batch: int) -> None:
    """Rewrite, in place, the attention of one exported (B, T) graph of batch_model.BatchCaches."""
    from onnx import TensorProto, helper, numpy_helper

    if model_cfg.qk_norm:
        raise AttentionRewriteError("fused attention does not cover q/k norms (this model has them): "
                                    "set graphs.ort_attention: graph")
    graph = model.graph
    gemms = {node.input[1]: node for node in graph.node if node.op_type == "Gemm" and len(node.input) >= 2}
    hkv, heads, dim = model_cfg.n_kv_heads, model_cfg.n_heads, model_cfg.head_dim
    per_slot = width > 1
    cos, sin = rotary_tables(model_cfg, cache_rows)

    def const(name: str, value) -> str:
        new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    new_inits: list = []
    const("fused_rotary_cos", cos)
    const("fused_rotary_sin", sin)
    const("fused_width_minus_1", np.array([width - 1], np.int32))
    const("fused_width", np.array(width, np.int32))
    const("fused_axis0", np.array([0], np.int64))
    const("fused_out_shape", np.array([batch * width, heads * dim], np.int64))
    const("fused_bt_shape", np.array([batch, width, -1], np.int64))
    prelude = [helper.make_node("Cast", [io_names.POSITION], ["fused_position32"], name="fused_position32",
                                to=TensorProto.INT32)]  # (B,)
    if per_slot:
        for b in range(batch):
            const(f"bslot_{b}", np.array([b], np.int64))
            const(f"bslot_{b + 1}", np.array([b + 1], np.int64))
            const(f"brows_{b}", np.array([b * width], np.int64))
            const(f"brows_{b + 1}", np.array([(b + 1) * width], np.int64))
            prelude += [
                helper.make_node("Slice", ["fused_position32", f"bslot_{b}", f"bslot_{b + 1}", "fused_axis0"],
                                 [f"fused_position32_s{b}"], name=f"fused_position32_s{b}"),  # (1,)
                helper.make_node("Add", [f"fused_position32_s{b}", "fused_width_minus_1"], [f"fused_seqlens_k_s{b}"],
                                 name=f"fused_seqlens_k_s{b}"),
                helper.make_node("Squeeze", [f"fused_position32_s{b}", "fused_axis0"], [f"fused_position_scalar_s{b}"],
                                 name=f"fused_position_scalar_s{b}"),
                helper.make_node("Add", [f"fused_position_scalar_s{b}", "fused_width"], [f"fused_total_len_s{b}"],
                                 name=f"fused_total_len_s{b}")]
    else:
        prelude += [
            helper.make_node("Add", ["fused_position32", "fused_width_minus_1"], ["fused_seqlens_k"], name="fused_seqlens_k"),
            helper.make_node("ReduceMax", ["fused_position32"], ["fused_position_max"], name="fused_position_max",
                             keepdims=0),  # () the longest slot: the op's total_sequence_length
            helper.make_node("Add", ["fused_position_max", "fused_width"], ["fused_total_len"], name="fused_total_len")]

    def proj(layer: LayerIO, name: str):
        weight = f"{layer.weights}.{name}_proj.weight"
        if weight not in gemms:
            raise AttentionRewriteError(f"no Gemm reads {weight}: not a batched spec_edge export (re-export)")
        return gemms[weight]

    attention, present, cache_inputs = [], [], []
    for i, layer in enumerate(layers):
        q, k, v, o = (proj(layer, name) for name in ("q", "k", "v", "o"))
        rows = [node.output[0] for node in (q, k, v)]  # (B*T, X) each
        if per_slot:
            outs = []
            for b in range(batch):
                ins = []
                for role, name in zip("qkv", rows):
                    sliced, ins_name = f"fused_{role}_{i}_s{b}_rows", f"fused_{role}_{i}_s{b}"
                    attention += [helper.make_node("Slice", [name, f"brows_{b}", f"brows_{b + 1}", "fused_axis0"],
                                                   [sliced], name=sliced),  # (T, X)
                                  helper.make_node("Unsqueeze", [sliced, "fused_axis0"], [ins_name], name=ins_name)]
                    ins.append(ins_name)  # (1, T, X)
                names = [io_names.slot_name(n, b) for n in (layer.k_cache, layer.v_cache, layer.k_present, layer.v_present)]
                attention.append(helper.make_node(
                    "GroupQueryAttention", ins + names[:2] + [f"fused_seqlens_k_s{b}", f"fused_total_len_s{b}",
                                                              "fused_rotary_cos", "fused_rotary_sin"],
                    [f"fused_attn_{i}_s{b}"] + names[2:], name=f"fused_gqa_{i}_s{b}", domain=MS_DOMAIN,
                    num_heads=heads, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=0))
                outs.append(f"fused_attn_{i}_s{b}")
                cache_inputs += names[:2]
                present += names[2:]
            attention.append(helper.make_node("Concat", outs, [f"fused_attn_{i}"], name=f"fused_attn_{i}", axis=1))
        else:
            ins = []
            for role, name in zip("qkv", rows):
                ins.append(f"fused_{role}_{i}")
                attention.append(helper.make_node("Reshape", [name, "fused_bt_shape"], [ins[-1]], name=ins[-1]))
            attention.append(helper.make_node(
                "GroupQueryAttention", ins + [layer.k_cache, layer.v_cache, "fused_seqlens_k", "fused_total_len",
                                              "fused_rotary_cos", "fused_rotary_sin"],
                [f"fused_attn_{i}", layer.k_present, layer.v_present], name=f"fused_gqa_{i}", domain=MS_DOMAIN,
                num_heads=heads, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=0))
            cache_inputs += [layer.k_cache, layer.v_cache]
            present += [layer.k_present, layer.v_present]
        attention.append(helper.make_node("Reshape", [f"fused_attn_{i}", "fused_out_shape"], [f"fused_attn2d_{i}"],
                                          name=f"fused_attn2d_{i}"))  # (B*T, H*D)
        o.input[0] = f"fused_attn2d_{i}"

    cache_shape = [1 if per_slot else batch, hkv, cache_rows, dim]
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
