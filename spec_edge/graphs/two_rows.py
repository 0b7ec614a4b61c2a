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
and over the 30 layers of the embedded default a verify row ended ~1 logit away from the [1, 1] step
at the same position (speculative output == target-only on 12/36 bench runs). So a width-1 graph
feeds each 4-bit MatMulNBits and each attention its row stacked twice and keeps row 0; every row of
every call width then runs the same float operations, bit for bit (test/test_quantize.py). The
8-bit LM head (Q8_0) has one kernel for every M and is left alone.

fp32 activations (q4_fp32act, accuracy level 0) differ the same way, but nothing rounds them
afterwards (their verify rows stay within ~5e-5 of the steps), and their multi-row path
dequantizes the whole matrix on every call: those graphs are left as they are.
"""
from __future__ import annotations

import numpy as np

LEVELS = (4,)  # MatMulNBits accuracy levels whose width-1 graphs run two rows
START, END = "two_rows_start", "two_rows_end"  # Slice bounds [0, 1) (END also names axis 1)


def applies(width: int, accuracy_level: int) -> bool:
    return width == 1 and accuracy_level in LEVELS


def _bounds(new_inits: list) -> None:
    from onnx import numpy_helper

    if not any(t.name == START for t in new_inits):
        new_inits.append(numpy_helper.from_array(np.array([0], np.int64), START))
        new_inits.append(numpy_helper.from_array(np.array([1], np.int64), END))


def matmul(node, doubled: dict[str, str], new_nodes: list, new_inits: list) -> None:
    """Emit a MatMulNBits node (x (1, K) -> y (1, N)) as MatMulNBits over x stacked twice, (2, K),
    and a Slice of row 0. doubled: x -> its two-row copy, shared by the nodes that read x."""
    from onnx import helper

    _bounds(new_inits)
    x, y = node.input[0], node.output[0]
    if x not in doubled:
        doubled[x] = f"{x}_two_rows"
        new_nodes.append(helper.make_node("Concat", [x, x], [doubled[x]], name=doubled[x], axis=0))
    node.input[0], node.output[0] = doubled[x], f"{y}_two_rows"
    new_nodes.append(node)
    new_nodes.append(helper.make_node("Slice", [node.output[0], START, END, START], [y], name=f"{node.name}_row0"))


def attention(nodes: list, new_inits: list) -> list:
    """The nodes with each GroupQueryAttention run on its row stacked twice, (1, 2, X), keeping row
    0 of its output. The copy lands in the cache row after the position, which no call reads before
    writing it again (the fused graphs' cache_rows leave room past the last position)."""
    from onnx import helper, numpy_helper

    out = []
    for node in nodes:
        if node.op_type != "GroupQueryAttention":
            out.append(node)
            continue
        if not any(t.name == "two_rows_one" for t in new_inits):  # seqlens_k and total_len of a width-2 call
            _bounds(new_inits)
            new_inits.append(numpy_helper.from_array(np.array([1], np.int32), "two_rows_one"))
            new_inits.append(numpy_helper.from_array(np.array(1, np.int32), "two_rows_one_scalar"))
            out.append(helper.make_node("Add", [node.input[5], "two_rows_one"], ["two_rows_seqlens_k"],
                                        name="two_rows_seqlens_k"))
            out.append(helper.make_node("Add", [node.input[6], "two_rows_one_scalar"], ["two_rows_total_len"],
                                        name="two_rows_total_len"))
        for slot in range(3):  # packed qkv (or q, k, v): (1, 1, X) -> (1, 2, X)
            if node.input[slot]:
                doubled = f"{node.input[slot]}_two_rows"
                out.append(helper.make_node("Concat", [node.input[slot]] * 2, [doubled], name=doubled, axis=1))
                node.input[slot] = doubled
        node.input[5], node.input[6] = "two_rows_seqlens_k", "two_rows_total_len"
        row0 = node.output[0]
        node.output[0] = f"{row0}_two_rows"
        out.append(node)
        out.append(helper.make_node("Slice", [node.output[0], START, END, END], [row0],
                                    name=f"{node.name}_row0"))  # (1, 2, H*D) -> (1, 1, H*D): axis 1
    return out
