"""4-bit weights for the ONNX Runtime backend: the GGUF's own Q4_1 blocks carried into MatMulNBits.

graphs.weights = q4 rewrites the exported fp32 graphs after export (a post-export ONNX pass); it
never re-quantizes. Every linear weight of the target that the GGUF stores as Q4_1 (blocks of 32
along the input dimension, w = d * q + m with fp16 d and m, 4-bit q) becomes a com.microsoft
MatMulNBits node with exactly those codes and scales, and the tied LM head, stored as Q8_0
(w = d * q, int8 q), becomes an 8-bit MatMulNBits node.

Why the minimum is carried beside the node, not as its zero point: MatMulNBits dequantizes
(code - zero_point) * scale. With scale = d, Q4_1 needs zero_point = -m / d, which is not an
integer, so the packed 4-bit uint8 zero points cannot hold it. The op does accept float zero points
(same type as A, unpacked, shape (N, blocks)), but ONNX Runtime's CPU kernel then dequantizes the
whole matrix on every call (docs/bench.md, "The 4-bit path"). So each Q4_1 linear layer is written as

    y = MatMulNBits(x; codes q, scale d, zero point 0) + BlockSum32(x) @ M      M[b, n] = m[n, b]

which is the same sum, d*q + m per weight, regrouped: BlockSum32(x) is x reshaped to
(T, K/32, 32) and summed over the last axis, and M costs K/32 x N floats (1/8 of the 4-bit codes).
Weights are exact; only float summation order differs from the fp32 graph (parity: test_quantize.py
and `spec-edge bench --weights fp32 q4`). With int8 activations (q4) a step graph runs its token
twice, as a width-2 call, so that each row of a verify call equals the step at its position bit for
bit (graphs/two_rows.py says why; without it speculative output drifted from target-only).

q/k rows: transformers un-permutes the GGUF's q/k rows (rotary layout) when it loads, so each ONNX
row is matched to its GGUF row by value (the dequantized fp32 row must be identical, byte for byte);
that match is also the proof that no second rounding happened. A weight without an exact match is
refused, never re-quantized.

    <engine_dir>/<profile>/onnx/<form>_fused_q4/   the stems of <form>_fused/ the plan runs, its identity plus
                                                   "weights": "q4" (graphs of m > 1 rows: no two-row step)

Draft heads are the one place weights are rounded (graphs.head_weights q8, ensure_head_q8): a head
has no GGUF blocks, its drafts are always verified by the target, and its step is small enough that
reading fp32 weights is most of its cost. Its linear weights become Q8_0 blocks (8-bit MatMulNBits):

    <engine_dir>/<profile>/onnx/eagle3-<form>_fused_q8/   same stems and manifest as its _fused/,
                                                          plus "head_weights": "q8"
"""
from __future__ import annotations

import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.graphs import plan, two_rows
from spec_edge.graphs.folders import folder_stamp
from spec_edge.graphs.gguf_blocks import (Q41, Q80, QK, QuantizeError, blocks_for, matmulnbits_q4_1, matmulnbits_q8_0,
                                          quantize_q8_0)

MS_DOMAIN = "com.microsoft"
Q4_FORMAT = 4            # 2: sibling Q4_1 layers stacked into one MatMulNBits; 3: packed QKV into fused
                         # attention; 4: step graphs run their token twice (two_rows.py); older folders are redone
Progress = Callable[[str], None]
Blocks = Callable[[str, np.ndarray], object | None]  # (initializer name, its fp32 (N, K) weight) -> Q41 / Q80 / None


# ---------------------------------------------------------------------------------------------
# The ONNX rewrite


@dataclass
class RewriteReport:
    q4_layers: int = 0
    q8_layers: int = 0
    kept_fp32: list[str] = None
    fp32_bytes_removed: int = 0
    quant_bytes_added: int = 0


def rewrite_model(model, blocks: Callable[[str], object | None], *, accuracy_level: int = 0,
                  merge: bool = True, width: int = 0) -> RewriteReport:
    """Replace, in place, every Gemm(x, W, transB=1) and MatMul(x, Transpose(W)) whose W `blocks(name)`
    returns Q41 / Q80 blocks for (already row-matched to W) with MatMulNBits; with merge, Q4_1 layers
    that read the same input share one MatMulNBits (rows stacked) and a Split, and a stacked q/k/v
    that only feeds a GroupQueryAttention becomes its packed QKV input (pack_qkv). The fp32
    initializers that no node reads any more are dropped. q4_layers counts linear layers, merged or not.

    width: the graph's T (0: a drafter's graph, left as is). A width-1 fused-attention graph with
    int8 activations then runs its token twice, as a width-2 call, so that a step computes its row
    as a verify call does (graphs/two_rows.py)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    report = RewriteReport(kept_fp32=[])
    new_nodes = []
    new_inits = []
    block_sums: dict[str, str] = {}  # input name -> its BlockSum32 tensor (shared by q/k/v, gate/up)
    shape_const = None

    def attr(node, name, default):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    # pass 1: the weight (and its blocks) each linear node reads
    found = []  # (node, weight name, blocks or None)
    for node in graph.node:
        weight_name = None
        if node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in inits \
                and attr(node, "transB", 0) == 1 and attr(node, "transA", 0) == 0 and attr(node, "alpha", 1.0) == 1.0:
            weight_name = node.input[1]
        elif node.op_type == "MatMul" and node.input[1] in producers:
            prod = producers[node.input[1]]
            if prod.op_type == "Transpose" and prod.input[0] in inits and list(attr(prod, "perm", [1, 0])) == [1, 0]:
                weight_name = prod.input[0]
        q = blocks(weight_name) if weight_name else None
        if isinstance(q, Q80) and accuracy_level < 4:
            q = None  # 8-bit MatMulNBits at accuracy level 0 dequantizes the whole matrix every call
        found.append((node, weight_name, q))
    # Q4_1 layers that read the same input (q/k/v, gate/up) become one MatMulNBits over their rows
    # stacked, then a Split: fewer, wider kernels (each column's sum is the same)
    siblings: dict[str, list[int]] = defaultdict(list)
    if merge:
        for i, (node, _, q) in enumerate(found):
            if isinstance(q, Q41):
                siblings[node.input[0]].append(i)

    # pass 2: emit
    for i, (node, weight_name, q) in enumerate(found):
        if q is None:
            new_nodes.append(node)
            continue
        group = siblings.get(node.input[0], [])
        if len(group) > 1 and i != group[0]:
            continue  # emitted with the first of its group
        outputs = [node.output[0]]
        if len(group) > 1:
            members = [found[j] for j in group]
            q = Q41(codes=np.concatenate([m[2].codes for m in members]), d=np.concatenate([m[2].d for m in members]),
                    m=np.concatenate([m[2].m for m in members]))
            weight_name = "+".join(m[1] for m in members)
            outputs = [m[0].output[0] for m in members]
            report.q4_layers += len(members) - 1
        x = node.input[0]
        n, k = q.codes.shape
        base = weight_name.replace("/", "_")
        bits = 4 if isinstance(q, Q41) else 8
        parts = matmulnbits_q4_1(q) if bits == 4 else matmulnbits_q8_0(q)
        suffix = f"_q{bits}"
        for key in ("B", "scales", "zero_points"):
            new_inits.append(numpy_helper.from_array(parts[key], f"{base}{suffix}_{key}"))
            report.quant_bytes_added += parts[key].nbytes
        out = outputs[0] if len(outputs) == 1 else f"{base}_q4_stacked"
        main_out = out if bits == 8 else f"{out}_q4main"
        new_nodes.append(helper.make_node(
            "MatMulNBits", [x] + [f"{base}{suffix}_{key}" for key in ("B", "scales", "zero_points")], [main_out],
            name=f"{node.name}_nbits", domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=QK,
            accuracy_level=accuracy_level))
        if bits == 4:
            report.q4_layers += 1
            if x not in block_sums:
                if shape_const is None:
                    shape_const = "q4_blocksum_shape"
                    new_inits.append(numpy_helper.from_array(np.array([0, -1, QK], np.int64), shape_const))
                blocked, summed = f"{x}_blocks32", f"{x}_blocksum32"
                new_nodes.append(helper.make_node("Reshape", [x, shape_const], [blocked], name=f"{x}_q4_reshape"))
                new_nodes.append(helper.make_node("ReduceSum", [blocked, "q4_sum_axes"], [summed],
                                                  name=f"{x}_q4_blocksum", keepdims=0))
                block_sums[x] = summed
            mins = f"{base}_q4_mins"
            new_inits.append(numpy_helper.from_array(parts["mins"], mins))
            report.quant_bytes_added += parts["mins"].nbytes
            new_nodes.append(helper.make_node("MatMul", [block_sums[x], mins], [f"{out}_q4min"],
                                              name=f"{node.name}_q4min"))
            new_nodes.append(helper.make_node("Add", [main_out, f"{out}_q4min"], [out], name=f"{node.name}_q4add"))
            if len(outputs) > 1:
                split = f"{base}_q4_split"
                new_inits.append(numpy_helper.from_array(
                    np.array([m[2].codes.shape[0] for m in (found[j] for j in group)], np.int64), split))
                new_nodes.append(helper.make_node("Split", [out, split], outputs, name=f"{node.name}_q4split", axis=-1))
        else:
            report.q8_layers += 1
    if block_sums:
        new_inits.append(numpy_helper.from_array(np.array([-1], np.int64), "q4_sum_axes"))
    if merge:
        new_nodes = pack_qkv(new_nodes)
    del graph.node[:]
    graph.node.extend(new_nodes)
    used = {name for node in graph.node for name in node.input}
    keep = []
    for t in graph.initializer:
        if t.name in used:
            keep.append(t)
        else:
            report.fp32_bytes_removed += int(np.prod(t.dims)) * 4
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    # graph outputs are unchanged; drop stale value_info of rewritten tensors (they keep their shapes)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    if two_rows.applies(model, width, accuracy_level):
        two_rows.widen(model)
    return report


def pack_qkv(nodes: list) -> list:
    """Fused-attention graphs (ort_attention.py): where a stacked q/k/v result is split only to be
    unsqueezed into a GroupQueryAttention's query/key/value, give the op the stacked rows as its
    packed QKV input instead (one Unsqueeze, no Split: the op's own layout, (1, T, (H + 2 Hkv) D))."""
    from onnx import helper

    consumers: dict[str, list] = defaultdict(list)
    for node in nodes:
        for name in node.input:
            consumers[name].append(node)
    dropped, replaced = set(), {}
    for split in nodes:
        if split.op_type != "Split" or len(split.output) != 3:
            continue
        unsqueezes = [consumers[out][0] if len(consumers[out]) == 1 else None for out in split.output]
        # Unsqueeze (1, T, .) in a B=1 graph, Reshape (m, T, .) in one of m rows (gqa_rewrite.rewrite_rows)
        if any(u is None or u.op_type not in ("Unsqueeze", "Reshape") for u in unsqueezes):
            continue
        users = [consumers[u.output[0]] for u in unsqueezes]
        if any(len(u) != 1 for u in users):
            continue
        gqa = users[0][0]
        if gqa.op_type != "GroupQueryAttention" or any(u[0] is not gqa for u in users) \
                or list(gqa.input[:3]) != [u.output[0] for u in unsqueezes]:
            continue
        packed = f"{split.input[0]}_packed"
        replaced[id(unsqueezes[0])] = helper.make_node(unsqueezes[0].op_type, [split.input[0], unsqueezes[0].input[1]],
                                                       [packed],
                                                       name=f"{split.name}_packed")
        gqa.input[0], gqa.input[1], gqa.input[2] = packed, "", ""
        dropped.update({id(split), id(unsqueezes[1]), id(unsqueezes[2])})
    return [replaced.get(id(node), node) for node in nodes if id(node) not in dropped]


# ---------------------------------------------------------------------------------------------
# The artifact folder


def for_config(cfg, fp32_dir: Path, progress: Progress = print, graphs: dict[str, dict] | None = None) -> Path:
    """The graph folder for cfg.graphs.weights (q4 / q4_fp32act), made from the fp32 folder; graphs: the
    stems (-> specs) to have, default all of fp32_dir's."""
    from spec_edge.config import ConfigError
    from spec_edge.graphs.weights import resolve

    source = resolve(cfg.model.target)
    if source.suffix != ".gguf":
        raise ConfigError(f"graphs.weights={cfg.graphs.weights} carries a GGUF's Q4_1 blocks over; the target "
                          f"'{cfg.model.target}' is not a GGUF file (use weights fp32)")
    return ensure_q4(fp32_dir, source, plan.ACCURACY_LEVELS[cfg.graphs.weights], progress, graphs)


def ensure_q4(fp32_dir: Path, gguf_path: Path, accuracy_level: int = 0, progress: Progress = print,
              graphs: dict[str, dict] | None = None) -> Path:
    """The q4 copy of an fp32 folder, graph by graph (export.ensure_graphs; remade when the fp32
    folder's identity changes). The GGUF is read only when a graph is to be made."""
    fp32_dir = Path(fp32_dir)
    read: list[Blocks] = []

    def blocks(name: str, weight: np.ndarray):
        if not read:
            progress(f"[q4] carrying {gguf_path.name}'s Q4_1/Q8_0 blocks into MatMulNBits graphs ...")
            read.append(blocks_for(gguf_path))
        return read[0](name, weight)

    return convert_folder(fp32_dir, plan.q4_dir(fp32_dir, accuracy_level), blocks, accuracy_level=accuracy_level,
                          stamp=folder_stamp(fp32_dir), source=gguf_path.name, progress=progress, graphs=graphs)


def convert_folder(src: Path, dst: Path, blocks_for: Blocks, *, accuracy_level: int, stamp: str, source: str,
                   progress: Progress = print, graphs: dict[str, dict] | None = None) -> Path:
    """The folder dst holding `graphs` (default: all of the fp32 folder src's) rewritten by rewrite_model
    with the blocks blocks_for gives (asked once per weight, shared by all graphs), one shared
    weights.bin, and src's identity plus "weights": "q4"; made graph by graph (export.ensure_graphs)."""
    import onnx
    from onnx import numpy_helper

    from spec_edge.graphs import export

    src, dst = Path(src), Path(dst)
    manifest = json.loads((src / "manifest.json").read_text())
    graphs = dict(manifest["graphs"]) if graphs is None else graphs
    missing = sorted(set(graphs) - set(manifest["graphs"]))
    if missing:
        raise QuantizeError(f"{src} lacks the graphs {missing} to carry to q4")
    identity = {key: value for key, value in manifest.items() if key not in ("graphs", "made")}
    identity.update(weights="q4", q4_format=Q4_FORMAT, source_stamp=stamp, accuracy_level=accuracy_level)
    matched: dict[str, object] = {}  # by initializer name: the row-matched blocks (or None: keep fp32)

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        for stem, spec in todo.items():
            model = onnx.load(str(src / f"{stem}.onnx"), load_external_data=True)
            arrays = {t.name: t for t in model.graph.initializer}

            def blocks(name: str):
                if name not in matched:
                    matched[name] = blocks_for(name, numpy_helper.to_array(arrays[name])) if name in arrays else None
                return matched[name]

            width = int(spec["width"]) if spec["kind"] in ("step", "verify", "prefill", "prefill_image") else 0  # drafters keep M=1
            if int(spec.get("rows", 1)) > 1:
                width = 0  # graphs of m > 1 rows run M = m*T rows: no two-row step
            report = rewrite_model(model, blocks, accuracy_level=accuracy_level, width=width)
            if report.q4_layers == 0:  # never hand out fp32 graphs labelled q4
                raise QuantizeError(f"{src / stem}.onnx: no linear weight matched a Q4_1 tensor of {source} "
                                    f"(initializer names should be Hugging Face's, e.g. "
                                    f"model.layers.0.self_attn.q_proj.weight); re-export the graphs")
            export.save(model, folder / f"{stem}.onnx", store)
            progress(f"[q4]   {stem}: {report.q4_layers} Q4_1 + {report.q8_layers} Q8_0 layers")
        if fresh:
            for name in ("model.json", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy2(src / name, folder / name)
        return {}

    return export.ensure_graphs(dst, identity, graphs, make, progress, "[q4]")


# ---------------------------------------------------------------------------------------------
# Draft heads: 8-bit weights (graphs.head_weights q8)

HEAD_Q8_FORMAT = 1


def for_head(cfg, head_dir: Path, progress: Progress = print) -> Path:
    """The folder ONNX Runtime runs for an exported draft head (EAGLE-3, P-EAGLE, Medusa): head_dir
    itself for graphs.head_weights fp32, its 8-bit copy for q8."""
    if cfg.graphs.head_weights == "fp32":
        return Path(head_dir)
    return ensure_head_q8(head_dir, progress)


def ensure_head_q8(src_dir: Path, progress: Progress = print) -> Path:
    """The 8-bit copy <src_dir>_q8 of a head folder: every bias-free linear weight (K a multiple of
    32) rounded to Q8_0 blocks and run as MatMulNBits with int8 activations (accuracy level 4; level 0
    would dequantize the whole matrix on every call). Made graph by graph (export.ensure_graphs);
    remade when src_dir's identity changes."""
    import onnx
    from onnx import numpy_helper

    from spec_edge.graphs import export

    src_dir = Path(src_dir)
    manifest = json.loads((src_dir / "manifest.json").read_text())
    identity = {key: value for key, value in manifest.items() if key not in ("graphs", "made")}
    identity.update(head_weights="q8", head_q8_format=HEAD_Q8_FORMAT, q8_source_stamp=folder_stamp(src_dir))
    rounded: dict[str, Q80 | None] = {}  # by initializer name, shared by the graphs

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        progress(f"[q8] rounding the head's linear weights to 8 bits ({src_dir.name} -> {src_dir.name}_q8) ...")
        layers = 0
        for stem in todo:
            model = onnx.load(str(src_dir / f"{stem}.onnx"), load_external_data=True)
            arrays = {t.name: t for t in model.graph.initializer}

            def blocks(name: str) -> Q80 | None:
                if name not in rounded:
                    weight = numpy_helper.to_array(arrays[name]) if name in arrays else None
                    fits = weight is not None and weight.dtype == np.float32 and weight.ndim == 2 \
                        and weight.shape[1] % QK == 0
                    rounded[name] = quantize_q8_0(weight) if fits else None
                return rounded[name]

            report = rewrite_model(model, blocks, accuracy_level=4, merge=False)
            layers = max(layers, report.q8_layers)
            export.save(model, folder / f"{stem}.onnx", store)
        if layers == 0:
            raise QuantizeError(f"{src_dir}: no linear weight of the head could be rounded to 8 bits; set "
                                f"graphs.head_weights: fp32")
        if fresh:
            for name in export.head_side_files(src_dir):
                shutil.copy2(src_dir / name, folder / name)
        progress(f"[q8] {layers} linear layers per graph")
        return {}

    return export.ensure_graphs(plan.q8_dir(src_dir), identity, dict(manifest["graphs"]), make,
                                progress, "[q8]")
