"""The fused-attention rewrite of one graph (ONNX Runtime): each layer's attention becomes one
com.microsoft GroupQueryAttention node that writes its keys/values into the resident cache
(graphs/ort_attention.py makes the folders; rewrite_rows below makes the graphs of m > 1 rows).

graphs.ort_attention = fused rewrites the exported target graphs (and a draft model's, and an
EAGLE-3 head's) after export: a post-export ONNX pass like quantize.py; the exported graphs are
untouched. Per layer, everything between the q/k/v projections and the o
projection (rotary, the (T, S + T) mask, scores over the whole cache, softmax, P @ V: ~30 small
nodes) becomes

    GroupQueryAttention(q, k, v, k_cache_<i>, v_cache_<i>, seqlens_k, total_len, cos, sin)
        -> out, k_present_<i>, v_present_<i>

with the past and present buffers shared: the caller binds k_present_<i> to the same memory as
k_cache_<i>, so the node writes the T new (rotated) key rows at [position, position + T) in place
and attends over rows [0, position + T) only, not over all S rows. The rest of the graph contract
is unchanged (tokens, position, [last_index], logits, hidden); k_new / v_new are gone, and the
cache inputs become (1, Hkv, cache_rows, D) (the op's BNSH layout), a view of the caller's
(L, Hkv, cache_rows, D) cache. Rollback stays a move of the position: rows past it are never read.
(The q4 pass, run on these graphs, feeds the stacked q/k/v rows in as the op's packed QKV input.)

    seqlens_k = position + T - 1   (1,) int32   the op's "total length - 1"
    total_len = position + T       ()   int32
    cos, sin  (cache_rows, D/2) float32   the same inv_freq and float32 products as model.rope_and_mask

A padded call (the prefill chunk, a head's ingest) writes its padding rows too (they are real rows
to the op), so the cache has room for them: cache_rows = S + the widest padded width (manifest
"cache_rows"); positions and check_room still stop at S.

    <engine_dir>/<profile>/onnx/<folder>_fused/   same stems and manifest, plus "attention": "fused"
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.node_order import topological

MS_DOMAIN = "com.microsoft"
FUSED_FORMAT = 1  # bumped when the rewrite changes: older fused folders are redone
Progress = Callable[[str], None]


class AttentionRewriteError(RuntimeError):
    """The graphs cannot be given fused attention; the message says why."""


def rotary_tables(model_cfg, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(n_rows, D/2) cos and sin, computed with the exported graphs' own float32 ops (model.rope_and_mask)."""
    import torch

    from spec_edge.graphs.model import rope_inv_freq

    positions = torch.arange(n_rows, dtype=torch.int64)
    freqs = positions.float()[:, None] * rope_inv_freq(model_cfg)[None, :]  # (S, D/2)
    return freqs.cos().numpy(), freqs.sin().numpy()


@dataclass(frozen=True)
class LayerIO:
    """One attention layer to rewrite: its projections' weight prefix and its cache tensor names."""
    weights: str    # e.g. "model.layers.0.self_attn" (reads <weights>.q_proj.weight ...)
    k_cache: str    # input (1, Hkv, cache_rows, D)
    v_cache: str
    k_present: str  # output bound to the same memory as k_cache
    v_present: str


def target_layers(n_layers: int) -> list[LayerIO]:
    """The target's (or its layer-skip prefix's) layers, named as io_names defines them."""
    return [LayerIO(f"model.layers.{i}.self_attn", io_names.k_cache(i), io_names.v_cache(i),
                    io_names.k_present(i), io_names.v_present(i)) for i in range(n_layers)]


HEAD_LAYERS = [LayerIO("midlayer.self_attn", io_names.K_CACHE, io_names.V_CACHE,  # the EAGLE-3 head's one layer
                       io_names.K_PRESENT, io_names.V_PRESENT)]


def projections(graph) -> Callable[[LayerIO, str], Any]:
    """proj(layer, "q" | "k" | "v" | "o"): the Gemm node of that projection of a layer in an exported graph;
    AttentionRewriteError when no Gemm reads its weight (not a spec_edge export, or already rewritten)."""
    gemms = {node.input[1]: node for node in graph.node if node.op_type == "Gemm" and len(node.input) >= 2}

    def proj(layer: LayerIO, name: str):
        weight = f"{layer.weights}.{name}_proj.weight"
        if weight not in gemms:
            raise AttentionRewriteError(f"no Gemm reads {weight}: the graph is not a spec_edge export of the current "
                                        f"format (re-export), or it was already rewritten")
        return gemms[weight]
    return proj


def rewrite_model(model, model_cfg, layers: list[LayerIO], width: int, cache_rows: int) -> None:
    """Rewrite, in place, the attention of the given layers of one exported graph of width T. The
    cache inputs/outputs become (1, Hkv, cache_rows, D)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if model_cfg.qk_norm:
        raise AttentionRewriteError("fused attention does not cover q/k norms (this model has them): "
                                    "set graphs.ort_attention: graph")
    graph = model.graph
    proj = projections(graph)
    hkv, heads, dim = model_cfg.n_kv_heads, model_cfg.n_heads, model_cfg.head_dim

    cos, sin = rotary_tables(model_cfg, cache_rows)
    new_inits = [numpy_helper.from_array(cos, "fused_rotary_cos"), numpy_helper.from_array(sin, "fused_rotary_sin"),
                 numpy_helper.from_array(np.array([width - 1], np.int32), "fused_width_minus_1"),
                 numpy_helper.from_array(np.array(width, np.int32), "fused_width"),
                 numpy_helper.from_array(np.array([0], np.int64), "fused_axis0"),
                 numpy_helper.from_array(np.array([width, heads * dim], np.int64), "fused_out_shape")]
    prelude = [
        helper.make_node("Cast", [io_names.POSITION], ["fused_position32"], name="fused_position32", to=TensorProto.INT32),
        helper.make_node("Add", ["fused_position32", "fused_width_minus_1"], ["fused_seqlens_k"], name="fused_seqlens_k"),
        helper.make_node("Squeeze", ["fused_position32", "fused_axis0"], ["fused_position_scalar"],
                         name="fused_position_scalar"),
        helper.make_node("Add", ["fused_position_scalar", "fused_width"], ["fused_total_len"], name="fused_total_len"),
    ]
    attention = []
    for i, layer in enumerate(layers):
        q, k, v, o = (proj(layer, name) for name in ("q", "k", "v", "o"))
        ins = []
        for role, node in (("q", q), ("k", k), ("v", v)):
            ins.append(f"fused_{role}_{i}")
            attention.append(helper.make_node("Unsqueeze", [node.output[0], "fused_axis0"], [ins[-1]],
                                              name=f"fused_{role}_{i}"))  # (1, T, H*D)
        attention.append(helper.make_node(
            "GroupQueryAttention",
            ins + [layer.k_cache, layer.v_cache, "fused_seqlens_k", "fused_total_len",
                   "fused_rotary_cos", "fused_rotary_sin"],
            [f"fused_attn_{i}", layer.k_present, layer.v_present], name=f"fused_gqa_{i}", domain=MS_DOMAIN,
            num_heads=heads, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=0))
        attention.append(helper.make_node("Reshape", [f"fused_attn_{i}", "fused_out_shape"],
                                          [f"fused_attn2d_{i}"], name=f"fused_attn2d_{i}"))  # (T, H*D)
        o.input[0] = f"fused_attn2d_{i}"

    # outputs: k_new / v_new go, the present caches come (all keys, then all values)
    cache_shape = [1, hkv, cache_rows, dim]
    kept = [out for out in graph.output if out.name not in (io_names.K_NEW, io_names.V_NEW)]
    del graph.output[:]
    graph.output.extend(kept)
    for name in [layer.k_present for layer in layers] + [layer.v_present for layer in layers]:
        graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_shape))
    cache_inputs = {layer.k_cache for layer in layers} | {layer.v_cache for layer in layers}
    for value in graph.input:
        if value.name in cache_inputs:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            dims.extend(onnx.TensorShapeProto.Dimension(dim_value=size) for size in cache_shape)

    # keep only what the outputs still need (the old rotary/mask/score nodes fall away)
    prune_and_sort(model, prelude + list(graph.node) + attention, new_inits)


def prune_and_sort(model, nodes: list, new_inits: list) -> None:
    """Give model.graph the given nodes, keeping only what its outputs still need (the old rotary /
    mask / score nodes fall away), in topological order, with the initializers still read (new_inits
    added) and the com.microsoft opset."""
    from onnx import helper

    graph = model.graph
    producer = {out: node for node in nodes for out in node.output}
    needed, stack, live = set(), [out.name for out in graph.output], set()
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in live:
            live.add(id(node))
            stack.extend(i for i in node.input if i)
    order = [node for node in nodes if id(node) in live]
    # topological order: the rewritten o projections now read nodes appended after them
    done = {value.name for value in graph.input} | {t.name for t in graph.initializer} | {t.name for t in new_inits}
    try:
        sorted_nodes = topological(order, done)
    except ValueError as err:
        raise AttentionRewriteError(f"rewritten graph has a cycle or a missing input near {err}") from None
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    used = {name for node in graph.node for name in node.input}
    keep = [t for t in list(graph.initializer) + new_inits if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    produced = {out for node in graph.node for out in node.output}
    kept_info = [info for info in graph.value_info if info.name in produced]  # drop the removed tensors' shapes
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def rewrite_rows(model, model_cfg, layers: list[LayerIO], width: int, cache_rows: int, rows: int) -> None:
    """Turn, in place, one exported rows=1 graph (any width: step_1 serves) into a graph of m = rows rows
    of `width` tokens each, with fused attention:

        tokens (m, T) -Reshape-> (1, m*T): the exported graph's embedding, norms, MLPs and head run on the
        m*T rows as they would on one sequence of m*T tokens (none of them mixes rows; their shapes are
        not baked in once the exported attention is gone); per layer, attention per row j:
        q/k/v (m*T, X) -Reshape-> (m, T, X) -Split(axis 0)-> m x (1, T, X)       (3 Splits per layer)
        row j: GroupQueryAttention(q_j, k_j, v_j, k_cache_i_s<j>, v_cache_i_s<j>, seqlens_k_j, total_len_j,
                                   cos, sin) -> (1, T, H*D), k_present_i_s<j>, v_present_i_s<j>
        Concat(axis 1) -> (1, m*T, H*D) -Reshape-> (m*T, H*D) -> o projection
        seqlens_k_j = position[j] + T - 1 (1,) int32, total_len_j = position[j] + T () int32
        logits (m*T, V) -Reshape-> (m, T, V); hidden (m*T, n*H) -> (m, T, n*H)

    Row j's cache input <k_cache_i>_s<j> (1, Hkv, R, D) (io_names.slot_name) and in-place output are
    bound to whichever slot's region row j serves (runtime/backends/ort_runner.py; padding rows: a scratch
    region), so one graph runs any m of the slots. Each row's node is the B=1 graph's node for that slot
    (test/test_rows.py: bit for bit). One node per row is also what ONNX Runtime's CPU kernel asks for
    T > 1 ("batch_size must be 1 when sequence_length > 1 and past context is given"). The shapes the
    exporter recorded for one row no longer hold: the rewritten graph keeps none (ONNX Runtime infers them)."""
    from onnx import TensorProto, helper, numpy_helper

    if model_cfg.qk_norm:
        raise AttentionRewriteError("fused attention does not cover q/k norms (this model has them): "
                                    "graphs of several rows need it, set graphs.batch_slots: 1")
    graph = model.graph
    hkv, heads, dim = model_cfg.n_kv_heads, model_cfg.n_heads, model_cfg.head_dim
    row_range = range(rows)
    cos, sin = rotary_tables(model_cfg, cache_rows)
    new_inits = [numpy_helper.from_array(np.asarray(value), name) for name, value in (
        ("fused_rotary_cos", cos), ("fused_rotary_sin", sin),
        ("fused_width_minus_1", np.array([width - 1], np.int32)), ("fused_width", np.array(width, np.int32)),
        ("fused_axis0", np.array([0], np.int64)), ("fused_out_shape", np.array([rows * width, heads * dim], np.int64)),
        ("fused_bt_shape", np.array([rows, width, -1], np.int64)), ("fused_row_split", np.ones(rows, np.int64)),
        ("fused_flat_tokens_shape", np.array([1, rows * width], np.int64)))]
    # the tokens as one sequence of m*T for the exported embedding; the outputs back to (m, T, .)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == io_names.TOKENS:
                node.input[i] = "fused_tokens_flat"
    producer = {out: node for node in graph.node for out in node.output}
    epilogue = []
    for name in [value.name for value in graph.output if value.name in (io_names.LOGITS, io_names.HIDDEN)]:
        node = producer[name]
        node.output[list(node.output).index(name)] = f"fused_{name}_flat"
        epilogue.append(helper.make_node("Reshape", [f"fused_{name}_flat", "fused_bt_shape"], [name],
                                         name=f"fused_{name}_rows"))
    positions = [f"fused_position32_s{j}" for j in row_range]  # (1,) each
    prelude = [helper.make_node("Reshape", [io_names.TOKENS, "fused_flat_tokens_shape"], ["fused_tokens_flat"],
                                name="fused_tokens_flat"),
               helper.make_node("Cast", [io_names.POSITION], ["fused_position32"], name="fused_position32",
                                to=TensorProto.INT32),  # (m,)
               helper.make_node("Split", ["fused_position32", "fused_row_split"], positions, name="fused_position_rows",
                                axis=0)]
    for j in row_range:
        prelude += [
            helper.make_node("Add", [positions[j], "fused_width_minus_1"], [f"fused_seqlens_k_s{j}"],
                             name=f"fused_seqlens_k_s{j}"),
            helper.make_node("Squeeze", [positions[j], "fused_axis0"], [f"fused_position_scalar_s{j}"],
                             name=f"fused_position_scalar_s{j}"),
            helper.make_node("Add", [f"fused_position_scalar_s{j}", "fused_width"], [f"fused_total_len_s{j}"],
                             name=f"fused_total_len_s{j}")]

    proj = projections(graph)

    attention, present, cache_inputs = [], [], []
    for i, layer in enumerate(layers):
        q, k, v, o = (proj(layer, name) for name in ("q", "k", "v", "o"))
        per_row = {}
        for role, node in zip("qkv", (q, k, v)):
            shaped, per_row[role] = f"fused_{role}_{i}", [f"fused_{role}_{i}_s{j}" for j in row_range]
            attention += [helper.make_node("Reshape", [node.output[0], "fused_bt_shape"], [shaped],
                                           name=shaped),  # (m, T, X)
                          helper.make_node("Split", [shaped, "fused_row_split"], per_row[role], name=f"{shaped}_rows",
                                           axis=0)]  # m x (1, T, X)
        outs = []
        for j in row_range:
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

    def value(name: str, elem: int, shape: list[int]):
        return helper.make_tensor_value_info(name, elem, shape)

    cache_shape = [1, hkv, cache_rows, dim]
    outputs = {out.name: out for out in graph.output}
    kept = [value(io_names.LOGITS, TensorProto.FLOAT, [rows, width, model_cfg.vocab_size])]
    if io_names.HIDDEN in outputs:
        hidden_width = outputs[io_names.HIDDEN].type.tensor_type.shape.dim[-1].dim_value
        kept.append(value(io_names.HIDDEN, TensorProto.FLOAT, [rows, width, hidden_width]))
    del graph.output[:]
    graph.output.extend(kept + [value(name, TensorProto.FLOAT, cache_shape) for name in present])
    old_caches = {layer.k_cache for layer in layers} | {layer.v_cache for layer in layers}
    inputs = {value_info.name: value_info for value_info in graph.input}
    del graph.input[:]
    graph.input.extend([value(io_names.TOKENS, TensorProto.INT64, [rows, width]),
                        value(io_names.POSITION, TensorProto.INT64, [rows])])
    graph.input.extend(info for name, info in inputs.items()
                       if name not in old_caches and name not in (io_names.TOKENS, io_names.POSITION))
    graph.input.extend(value(name, TensorProto.FLOAT, cache_shape) for name in cache_inputs)
    prune_and_sort(model, prelude + list(graph.node) + attention + epilogue, new_inits)
    del graph.value_info[:]  # recorded for one row of the exported width
