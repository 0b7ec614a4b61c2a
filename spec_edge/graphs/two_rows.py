"""Step graphs that compute their one row exactly as a verify call computes each of its rows
(graphs.weights q4: 4-bit MatMulNBits with int8 activations, graphs/quantize.py).

ONNX Runtime's CPU kernels quantize each row of x on its own (per row, per block of 32: rows never
share a scale), but run a one-row call through other code than a call of 2..128 rows:

  - MatMulNBits (MLAS SQ4BitGemm, CompInt8): M = 1 is a GEMV that applies the zero points inside
    its block loop; M > 1 a GEMM that folds them into a block-sum term;
  - GroupQueryAttention: its (T, .) products (Q K^T, P V) go through MLAS's SGEMM, which also runs
    one row otherwise than several.

Both agree up to float summation order (~1e-6 of the output), but the next layer rounds its input
to int8: a 1e-6 change flips some of those roundings, each worth 1/127 of a block's largest input,
so a verify row and the [1, 1] step at the same position can pick different tokens (docs/bench.md,
"Exactness of q4", has the measurements).

So a fused-attention step graph runs its token twice, as a width-2 call: the tokens (1, 1) are
stacked to (1, 2), every layer computes both rows (the same token at position and position + 1),
the copy's keys/values land in the cache row past the position, which no call reads before
writing it again (cache_rows leaves room past the last position), and the LM head and the other
row outputs take row 0 only. Every row of every call width then runs the same float operations,
bit for bit (test/test_quantize.py); the LM head (8-bit Q8_0 MatMulNBits) has one kernel for
every M, so it keeps its one row. Cost: the layers' work for two rows, no extra nodes per layer.

Not covered, left as they are: the exported attention (graphs.ort_attention graph), whose shapes
carry T throughout; and fp32 activations (q4_fp32act), never rounded afterwards, whose multi-row
path dequantizes the whole matrix on every call.
"""
from __future__ import annotations

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.gguf_blocks import QuantizeError
from spec_edge.graphs.node_order import topological

LEVELS = (4,)  # MatMulNBits accuracy levels whose width-1 graphs run two rows
# the fused-attention constants that carry the call's width (graphs/ort_attention.py)
WIDTH_CONSTANTS = ("fused_width", "fused_width_minus_1", "fused_out_shape")


def is_fused_step(model, width: int) -> bool:
    """A width-1 graph with ort_attention's fused attention (what widen can rewrite)."""
    names = {t.name for t in model.graph.initializer}
    return width == 1 and all(name in names for name in WIDTH_CONSTANTS)


def applies(model, width: int, accuracy_level: int) -> bool:
    return accuracy_level in LEVELS and is_fused_step(model, width)


def widen(model) -> None:
    """Rewrite, in place, a fused-attention width-1 graph into the width-2 call described above."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    for name in WIDTH_CONSTANTS:  # width 1 -> 2: seqlens_k, total_len, the attention output's (T, H*D)
        value = numpy_helper.to_array(inits[name]).copy()
        if name == "fused_out_shape":
            value[0] = 2
        else:
            value += 1
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "two_rows_start"),
                              numpy_helper.from_array(np.array([1], np.int64), "two_rows_end")])
    first = [helper.make_node("Concat", [io_names.TOKENS] * 2, ["tokens_two_rows"], name="tokens_two_rows",
                              axis=1)]  # (1, 1) -> (1, 2)
    for node in graph.node:
        node.input[:] = ["tokens_two_rows" if name == io_names.TOKENS else name for name in node.input]
    slices = []
    caches = {out.name for out in graph.output if out.name.startswith((io_names.K_PRESENT, io_names.V_PRESENT))}
    for out in graph.output:  # row outputs besides the logits (the heads' hidden states): (2, X) -> (1, X)
        if out.name in caches or out.name == io_names.LOGITS:
            continue
        wide = f"{out.name}_two_rows"
        for node in graph.node:  # its producer and any other reader keep both rows
            node.output[:] = [wide if name == out.name else name for name in node.output]
            node.input[:] = [wide if name == out.name else name for name in node.input]
        slices.append(helper.make_node("Slice", [wide, "two_rows_start", "two_rows_end", "two_rows_start"], [out.name],
                                       name=f"{out.name}_row0"))
    head = next(node for node in graph.node if io_names.LOGITS in node.output)
    if head.op_type not in ("MatMulNBits", "MatMul", "Gemm"):
        raise QuantizeError(f"two-row step graph: the logits come from a {head.op_type} node, not the LM head's "
                            f"matmul; re-export the graphs")
    row0 = f"{head.input[0]}_row0"  # the LM head reads row 0 only: (2, hidden) -> (1, hidden)
    slices.append(helper.make_node("Slice", [head.input[0], "two_rows_start", "two_rows_end", "two_rows_start"],
                                   [row0], name=row0))
    head.input[0] = row0
    # topological order: each Slice after its input's producer, before its readers
    known = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    try:
        ordered = topological(first + list(graph.node) + slices, known)
    except ValueError as err:
        raise QuantizeError(f"two-row step graph: {err} lost its inputs; re-export the graphs") from None
    del graph.node[:]
    graph.node.extend(ordered)
    del graph.value_info[:]  # they say T = 1
