"""The fused-attention rewrite of one graph (ONNX Runtime): each layer's attention becomes one
com.microsoft GroupQueryAttention node that writes its keys/values into the resident cache
(graphs/ort_attention.py makes the folders; graphs/batch_attention.py the (B, T) graphs' variant).

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


def rewrite_model(model, model_cfg, layers: list[LayerIO], width: int, cache_rows: int) -> None:
    """Rewrite, in place, the attention of the given layers of one exported graph of width T. The
    cache inputs/outputs become (1, Hkv, cache_rows, D)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if model_cfg.qk_norm:
        raise AttentionRewriteError("fused attention does not cover q/k norms (this model has them): "
                                    "set graphs.ort_attention: graph")
    graph = model.graph
    gemms = {}
    for node in graph.node:
        if node.op_type == "Gemm" and len(node.input) >= 2:
            gemms[node.input[1]] = node
    hkv, heads, dim = model_cfg.n_kv_heads, model_cfg.n_heads, model_cfg.head_dim

    def proj(layer: LayerIO, name: str):
        weight = f"{layer.weights}.{name}_proj.weight"
        if weight not in gemms:
            raise AttentionRewriteError(f"no Gemm reads {weight}: the graph is not a spec_edge export of format 2 "
                                        f"(re-export), or it was already rewritten")
        return gemms[weight]

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
