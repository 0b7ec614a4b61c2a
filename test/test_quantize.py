"""The 4-bit path: GGUF Q4_1 / Q8_0 blocks -> MatMulNBits without a second rounding.

- block parsing agrees with gguf's own dequantizer (nibble order, fp16 d and m);
- the packed MatMulNBits codes are the Q4_1 codes (no re-quantization), and a rewritten graph gives
  the fp32 graph's outputs within 1e-5 (relative to the output scale) with fp32 activations
  (accuracy_level 0), and within 2% with int8 activations (accuracy_level 4, llama.cpp's way);
- rows permuted by a loader (q/k rotary layout) are matched back bit for bit, a row that no block
  produced is refused."""
from __future__ import annotations

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.graphs import gguf_blocks, plan, quantize
from spec_edge.graphs.gguf_blocks import QuantizeError
from spec_edge.runtime.backends.onnxruntime import cpu_session
from tiny import run_alone

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def q8_0_rows(w: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 rows of an fp32 (N, K) matrix (llama.cpp's reference rounding)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
    inv = np.where(d != 0, 1 / np.where(d == 0, 1, d.astype(np.float32)), 0)
    q = np.clip(np.round(blocks * inv[..., None]), -128, 127).astype(np.int8)
    out = np.concatenate([d[..., None].view(np.uint8).reshape(n, -1, 2), q.view(np.uint8)], axis=-1)
    return out.reshape(n, -1)


def test_parse_matches_gguf_dequantizer():
    gguf_quants = pytest.importorskip("gguf.quants")
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    raw4 = gguf_blocks.quantize_q4_1(w)
    ref4 = gguf_quants.dequantize(raw4, gguf.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(gguf_blocks.parse_q4_1(raw4).dequantize(), ref4.reshape(8, 96))
    raw8 = q8_0_rows(w)
    ref8 = gguf_quants.dequantize(raw8, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(gguf_blocks.parse_q8_0(raw8).dequantize(), ref8.reshape(8, 96))


def test_packing_keeps_codes():
    rng = np.random.default_rng(1)
    q = gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal((4, 64)).astype(np.float32)))
    packed = gguf_blocks.pack_nbits_4(q.codes)  # (N, K/32, 16)
    low, high = packed & 0x0F, packed >> 4
    unpacked = np.stack([low, high], axis=-1).reshape(4, 64)  # low nibble first along K
    np.testing.assert_array_equal(unpacked, q.codes)


def _model(w1: np.ndarray, w2: np.ndarray, emb: np.ndarray, t: int):
    from onnx import TensorProto, helper, numpy_helper

    k = w1.shape[1]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, k])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [t, emb.shape[0]])
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["h1"], transB=1, name="g1"),
             helper.make_node("Gemm", ["h1", "w2"], ["h2"], transB=1, name="g2"),
             helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0], name="t"),
             helper.make_node("MatMul", ["h2", "emb_t"], ["logits"], name="head")]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(emb, "emb")]
    graph = helper.make_graph(nodes, "tiny", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(model, x):
    session = cpu_session(model.SerializeToString())
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("accuracy_level,tolerance", [(0, 1e-5), (4, 2e-2)])
def test_rewrite_parity(accuracy_level, tolerance):
    rng = np.random.default_rng(2)
    blocks = {"w1": gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal((96, 64)).astype(np.float32) * 0.1)),
              "w2": gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal((64, 96)).astype(np.float32) * 0.1)),
              "emb": gguf_blocks.parse_q8_0(q8_0_rows(rng.standard_normal((128, 64)).astype(np.float32)))}
    fp32 = _model(blocks["w1"].dequantize(), blocks["w2"].dequantize(), blocks["emb"].dequantize(), t=5)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    want = _run(fp32, x)
    q4 = _model(blocks["w1"].dequantize(), blocks["w2"].dequantize(), blocks["emb"].dequantize(), t=5)
    report = quantize.rewrite_model(q4, blocks.get, accuracy_level=accuracy_level)
    assert report.q4_layers == 2
    assert report.q8_layers == (1 if accuracy_level >= 4 else 0)  # 8-bit at level 0 would dequantize per call
    ops = [n.op_type for n in q4.graph.node]
    assert ops.count("MatMulNBits") == 2 + report.q8_layers and "Gemm" not in ops
    names = {t.name for t in q4.graph.initializer}
    assert "w1" not in names and "w2" not in names  # fp32 copies dropped
    got = _run(q4, x)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= tolerance * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("merge", [True, False])
def test_siblings_stack_into_one_matmulnbits(merge):
    """Q4_1 layers reading the same input (q/k/v, gate/up) become one MatMulNBits over their stacked
    rows and a Split, with the outputs of separate nodes (fp32 activations: within 1e-5)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    shapes = {"wa": (96, 64), "wb": (32, 64), "wc": (32, 64)}
    blocks = {name: gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal(shape).astype(np.float32) * 0.1))
              for name, shape in shapes.items()}
    nodes = [helper.make_node("Gemm", ["x", name], [f"y_{name}"], transB=1, name=f"g_{name}") for name in shapes]
    outputs = [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [5, shape[0]])
               for name, shape in shapes.items()]
    inits = [numpy_helper.from_array(b.dequantize(), name) for name, b in blocks.items()]
    graph = helper.make_graph(nodes, "siblings", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 64])],
                              outputs, inits)
    fp32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    q4 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    report = quantize.rewrite_model(q4, blocks.get, accuracy_level=0, merge=merge)
    assert report.q4_layers == 3
    ops = [n.op_type for n in q4.graph.node]
    assert ops.count("MatMulNBits") == (1 if merge else 3) and ops.count("Split") == (1 if merge else 0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    want = cpu_session(fp32.SerializeToString()).run(None, {"x": x})
    got = cpu_session(q4.SerializeToString()).run(None, {"x": x})
    for a, b in zip(got, want):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_rows_matched_after_permutation():
    rng = np.random.default_rng(3)
    q = gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal((16, 64)).astype(np.float32)))
    perm = rng.permutation(16)
    exported = q.dequantize()[perm]
    found = gguf_blocks.match_rows(exported, q.dequantize())
    np.testing.assert_array_equal(found, perm)
    moved = gguf_blocks.take_rows(q, found)
    np.testing.assert_array_equal(moved.dequantize(), exported)
    exported[3, 5] += 1e-3  # not what the blocks give: refuse rather than re-quantize
    with pytest.raises(QuantizeError, match="row 3"):
        gguf_blocks.match_rows(exported, q.dequantize())


def test_head_rounding_is_llama_cpp_q8_0():
    """quantize_q8_0 (draft heads only) gives llama.cpp's Q8_0 blocks, read back by parse_q8_0."""
    w = np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    ours, reference = gguf_blocks.quantize_q8_0(w), gguf_blocks.parse_q8_0(q8_0_rows(w))
    np.testing.assert_array_equal(ours.codes, reference.codes)
    np.testing.assert_array_equal(ours.d, reference.d)
    assert np.abs(ours.dequantize() - w).max() <= np.abs(w).max() / 127


def test_gguf_names():
    assert gguf_blocks.gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_blocks.gguf_name("model.layers.0.self_attn.o_proj.weight") == "blk.0.attn_output.weight"
    assert gguf_blocks.gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_blocks.gguf_name("model.norm.weight") is None


def test_config_field():
    from spec_edge.config import Config, ConfigError

    assert Config().graphs.weights == "q4"  # the default profile (test_default_profile.py)
    assert Config().graphs.head_weights == "q8"
    with pytest.raises(ConfigError, match="graphs.head_weights"):
        Config().replace(**{"graphs.head_weights": "q4"})
    assert Config().replace(**{"graphs.weights": "fp32"}).graphs.weights == "fp32"
    with pytest.raises(ConfigError, match="graphs.weights"):
        Config().replace(**{"graphs.weights": "int3"})
    with pytest.raises(ConfigError, match="onnxruntime"):
        Config().replace(**{"graphs.weights": "q4", "runtime.backend": "tensorrt", "graphs.dtype": "float16"})


# ---------------------------------------------------------------------------------------------
# q4 (int8 activations) on a whole model: a row's result does not depend on the call's width


def _fresh_blocks(name: str, weight: np.ndarray):
    """Blocks as a GGUF would hold them, made from the tiny model's own weights (the runtime never
    quantizes; here there is no GGUF): Q4_1 for the layers, Q8_0 for the LM head."""
    if weight.ndim != 2 or weight.shape[1] % 32 or name == "model.embed_tokens.weight":
        return None
    if name == "lm_head.weight":
        return gguf_blocks.quantize_q8_0(weight)
    return gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(weight))


@pytest.fixture(scope="module")
def tiny_q4(tiny_engine, tmp_path_factory):
    """The tiny target's fused graphs carried to 4-bit MatMulNBits with int8 activations (graphs.weights q4)."""
    from spec_edge.artifacts import ensure_packed
    from spec_edge.runtime.backends.ort_runner import b1_runner

    dst = tmp_path_factory.mktemp("q4") / "target_fused_q4"
    quantize.convert_folder(tiny_engine.graph_dir, dst, _fresh_blocks, accuracy_level=plan.ACCURACY_LEVELS["q4"],
                            stamp="tiny", source="tiny blocks", progress=lambda m: None)
    ensure_packed(dst, progress=lambda m: None)
    return b1_runner(dst)


def test_q4_verify_rows_equal_steps(tiny_q4):
    """Each row of a verify call gives, bit for bit, the logits the [1, 1] steps give at its position
    (and writes the same cache rows: later rows read them). ONNX Runtime's int8-activation kernels
    compute a single-row call otherwise than a multi-row one (~1e-6), and the next layer's int8
    rounding grows that to ~1 logit: without the two-row step graphs this fails at every width."""
    runner = tiny_q4
    ids = list(np.random.default_rng(5).integers(3, runner.vocab_size, 48))
    for width in sorted(runner.widths - {1}):
        for position in (9, 30):
            runner.prefill(ids[:position], 0)
            steps = np.stack([runner.forward([ids[position + i]], position + i)[0].copy() for i in range(width)])
            runner.prefill(ids[:position], 0)
            verify = runner.forward(ids[position:position + width], position)  # (width, V)
            np.testing.assert_array_equal(verify, steps, err_msg=f"verify[{width}] at position {position}")


def test_q4_speculative_equals_target_only(tiny_engine, tiny_q4):
    """Greedy speculative output on q4 == q4 target-only, token for token (exactness is against the
    quantized target itself), for prompt lookup and for the q4 graphs drafting for themselves: those
    drafts come from steps and are checked by verify rows, so they are all accepted only when the
    two agree."""
    from spec_edge.runtime import speculative
    from spec_edge.runtime.backends.ort_runner import b1_runner
    from spec_edge.runtime.drafters.draft_model import ModelDrafter
    from spec_edge.runtime.drafters.ngram import NgramDrafter
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.sampling import SamplingParams
    from speculated import assert_speculated
    from test_request_fields import PENALTIES

    self_drafter = ModelDrafter(b1_runner(tiny_q4.runner.graph_dir), name="self")
    for prompt in ("Move the arm to the left", "The robot picks up the red box. The robot picks up the"):
        ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=prompt))
        first = run_alone(tiny_q4.runner, speculative.SlotRequest(prompt_ids=ids, max_new_tokens=1, eos_ids=()))[0][0]
        # prompt lookup drafts the repeats of a favoured token (a random target never repeats itself)
        for drafter, k, sampling in ((NgramDrafter(), 4, PENALTIES(first)), (self_drafter, 3, SamplingParams()),
                                     (self_drafter, 7, SamplingParams())):
            plain, _, _ = run_alone(tiny_q4.runner, speculative.SlotRequest(
                prompt_ids=ids, max_new_tokens=40, eos_ids=tiny_engine.eos_ids, sampling=sampling))
            spec, _, stats = run_alone(tiny_q4.runner, speculative.SlotRequest(
                prompt_ids=ids, max_new_tokens=40, eos_ids=tiny_engine.eos_ids, sampling=sampling, drafter=drafter,
                k=k))
            assert spec == plain, (prompt, drafter.name, k)
            assert_speculated(stats, what=f"{prompt[:12]!r} {drafter.name} k={k}")
            if drafter is self_drafter:
                assert stats.acceptance_rate == 1.0, (prompt, k, stats)
