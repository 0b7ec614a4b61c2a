"""Q/DQ ONNX (graphs.weights int4_awq | int4_gguf | fp8 | nvfp4): the numbers, the files ONNX Runtime runs
against the torch model with the same rounded weights, speculative == target-only on every form, the
manifest record and the refusals.

- each form's codes are in range and dequantize to W within its precision; AWQ beats plain rounding on
  activations with outlier channels; Q4_1 blocks are carried with no second rounding (bit for bit);
- ONNX Runtime, running the Q/DQ files (nvfp4: their decoded twin), equals torch with the forms'
  effective weights (fp8: and its activation rounding) within tolerance, graph I/O unchanged and static;
- greedy speculative output == the quantized target's own greedy output (ngram and a draft model);
- a folder quantized otherwise than the profile is refused, naming the rebuild command;
- the TensorRT path writes the Q/DQ ONNX (dynamic T kept) without a GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spec_edge.config import Config, ConfigError
from spec_edge.graphs import export, gguf_blocks, io_names, qdq, qdq_formats as qf, weights
from spec_edge.runtime.backends.onnxruntime import OrtRunner, ort_graphs

onnx = pytest.importorskip("onnx")
REL_TOL = 5e-5
QUIET = lambda message: None  # noqa: E731
PROMPTS = ["The robot picks up the red box.", "Move the arm to the left, then open the gripper.",
           "Navigate to the kitchen and report the battery level."]


def close(got, want, tol=REL_TOL) -> bool:
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max()) < tol * max(1.0, float(np.abs(want).max()))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory, prompt_file):
    """A tiny checkpoint, exported once (static, fp32), with a calibration prompt file."""
    from tiny import make_checkpoint

    root = tmp_path_factory.mktemp("qdq")
    folder = make_checkpoint(root / "m", seed=3)
    cfg = Config().replace(**{"model.target": str(folder), "graphs.max_context": 64, "graphs.prefill_chunk": 8,
                              "graphs.k_values": [3], "speculative.k": 3, "graphs.layer_skip_layers": 1,
                              "runtime.engine_dir": str(root / "e"), "graphs.int4_block": 32,
                              "graphs.calibration": str(prompt_file), "graphs.ort_attention": "graph"})
    out = export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress=QUIET)
    return cfg, folder, out


def test_forms_round_to_their_precision():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    for form, worst in ((qf.int4_rtn(w, 32), 0.2), (qf.fp8_weight(w), 0.07), (qf.nvfp4_weight(w), 0.2)):
        err = np.abs(form.dequantize() - w).max(axis=1) / np.abs(w).max(axis=1)
        assert err.max() < worst, form.kind
    codes = qf.int4_rtn(w, 32).codes.astype(np.float32)
    assert codes.min() >= -8 and codes.max() <= 7 and np.all(codes == np.rint(codes))
    nv = qf.nvfp4_weight(w)
    assert nv.scale.dtype.name == "float8_e4m3fn" and nv.codes.dtype.name == "float4_e2m1fn"
    assert set(np.unique(np.abs(nv.codes.astype(np.float32)))) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}


def test_awq_beats_plain_rounding_on_outlier_channels():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    x[:, :4] *= 30  # a few channels carry most of the activation, as in real LLMs
    form, alpha = qf.int4_awq(w, np.abs(x).mean(axis=0), x, 128)
    plain = qf.int4_rtn(w, 128)
    awq_err = np.mean((x @ form.effective().T - x @ w.T) ** 2)
    rtn_err = np.mean((x @ plain.dequantize().T - x @ w.T) ** 2)
    assert alpha > 0 and awq_err < 0.8 * rtn_err


def test_q4_1_blocks_are_carried_bit_for_bit():
    rng = np.random.default_rng(2)
    q = gguf_blocks.parse_q4_1(gguf_blocks.quantize_q4_1(rng.standard_normal((16, 96)).astype(np.float32)))
    form = qf.int4_from_q4_1(q.codes, q.d, q.m)
    np.testing.assert_array_equal(form.codes.astype(np.int16), q.codes.astype(np.int16) - 8)  # no re-rounding
    np.testing.assert_array_equal(form.scale, q.d)
    np.testing.assert_array_equal(form.effective(), q.dequantize())  # d (q - 8) + (m + 8 d) == d q + m


def _reference_logits(folder, forms: dict, act_scales: dict, ids: list[int]) -> np.ndarray:
    """torch with every quantized linear weight replaced by its form's effective weight, fp8 inputs rounded."""
    from spec_edge.graphs import model

    model_cfg, state, _ = weights.load(str(folder))
    state = dict(state)
    for name, form in forms.items():
        state[name] = torch.from_numpy(form.effective())
    reference = model.build(model_cfg, state)
    for name, module in reference.named_modules():
        scale = act_scales.get(f"{name}.weight")
        if scale is not None:
            module.register_forward_pre_hook(
                lambda _m, args, s=scale: (torch.from_numpy(qf.fp8_round(args[0].numpy(), s)),))
    k_cache, v_cache = model.empty_cache(model_cfg, 64)
    with torch.no_grad():
        logits, _, _ = reference(torch.tensor([ids]), torch.tensor([0]), k_cache, v_cache)
    return logits[-1].numpy()


@pytest.mark.parametrize("form", ["int4_awq", "fp8", "nvfp4"])
def test_onnxruntime_runs_the_qdq_files_like_torch(small, form):
    cfg, folder, exported = small
    cfg = cfg.replace(**{"graphs.weights": form})
    graph_dir = ort_graphs(cfg, "target", exported, QUIET)
    qdq_dir = qdq.folder_for(exported, form)
    manifest = json.loads((qdq_dir / "manifest.json").read_text())
    assert manifest["weights"] == form and manifest["quantization"]["weights"] == form
    step = onnx.load(str(qdq_dir / "step_1.onnx"), load_external_data=False)
    plain = onnx.load(str(exported / "step_1.onnx"), load_external_data=False)
    assert [i.name for i in step.graph.input] == [i.name for i in plain.graph.input]
    assert [o.name for o in step.graph.output] == [o.name for o in plain.graph.output]
    assert sum(n.op_type == "DequantizeLinear" for n in step.graph.node) >= 7 * 4  # every linear of 4 layers
    # the rounded weights, read back from the very file (not recomputed)
    from onnx import numpy_helper

    prefill = onnx.load(str(qdq_dir / "prefill_8.onnx"))
    arrays = {t.name: numpy_helper.to_array(t) for t in prefill.graph.initializer}
    forms, act_scales = {}, {}
    for name in [n for n in arrays if n.endswith(f"_proj.weight_{'int4' if form == 'int4_awq' else form}")]:
        weight = name.rsplit("_", 1)[0]
        base = weight
        codes = arrays[name].T  # stored (K, N) for the MatMul; the forms are (N, K)
        if form == "nvfp4":
            f = qf.QuantWeight("nvfp4", codes, arrays[f"{base}_fp8_scale"].T, block=16,
                               global_scale=float(arrays[f"{base}_global_scale"]))
        elif form == "fp8":
            f = qf.QuantWeight("fp8", codes, arrays[f"{base}_scale"])
            act_scales[weight] = float(arrays[f"{base}_act_scale"])
        else:
            f = qf.QuantWeight("int4", codes, arrays[f"{base}_scale"].T, block=32, pre=arrays.get(f"{base}_awq_pre"))
        forms[weight] = f
    assert len(forms) == 7 * 4
    ids = list(range(5, 25))
    got = OrtRunner(graph_dir).prefill(ids, 0)
    assert close(got, _reference_logits(folder, forms, act_scales, ids), REL_TOL if form != "fp8" else 2e-3)


@pytest.mark.parametrize("form", ["int4_awq", "fp8", "nvfp4"])
def test_speculation_is_exact_on_each_form(tiny_cfg, prompt_file, form):
    from tiny import assert_greedy_equals_plain, plain

    from spec_edge.runtime import speculative
    from spec_edge.runtime.engine import Engine

    engine = Engine.from_config(tiny_cfg.replace(**{"graphs.weights": form, "graphs.calibration": str(prompt_file),
                                                    "graphs.int4_block": 32}), QUIET)
    assert qdq.folder_for(export.artifact_dir(tiny_cfg, "target").parent / "target_fused", form).is_dir()
    for name in ("draft", "layerskip"):  # a draft model (fp32) and the quantized target's own first layers
        assert_greedy_equals_plain(engine, engine.drafter(name), 4)
    ngram = engine.drafter("ngram")  # prompt lookup drafts only where the text repeats: equality on every prompt
    for prompt in PROMPTS + ["ab ab ab ab ab ab ab ab"]:
        ids = engine.tokenizer.encode(prompt)
        got, _, _ = speculative.generate(engine.target, ids, max_new_tokens=40, eos_ids=engine.eos_ids,
                                         drafter=ngram, k=4)
        assert got == plain(engine, ids, 40), prompt


def test_manifest_records_the_calibration_and_a_different_profile_is_refused(small, prompt_file, tmp_path):
    cfg, _, exported = small
    cfg = cfg.replace(**{"graphs.weights": "int4_awq"})
    folder = qdq.ensure_qdq(cfg, exported, exported, QUIET)
    manifest = json.loads((folder / "manifest.json").read_text())
    record = manifest["quantization"]
    from spec_edge.graphs import calibration

    assert record["method"] == "awq_lite" and record["block_size"] == 32
    assert record["calibration_sha256"] == calibration.texts_sha256(PROMPTS)
    assert manifest["quantization_detail"]["calibration_prompts"] == len(PROMPTS)
    qdq.check_profile(cfg, manifest, folder, "REBUILD")  # the profile it was made for passes
    other = tmp_path / "other.txt"
    other.write_text("A different calibration prompt.\n")
    for change, why in (({"graphs.calibration": str(other)}, "calibrated on another prompt set"),
                        ({"graphs.int4_block": 64}, "block size 32"),
                        ({"graphs.weights": "fp8"}, "holds int4_awq weights")):
        with pytest.raises(ConfigError, match=why) as err:
            qdq.check_profile(cfg.replace(**change), manifest, folder, "spec-edge export --weights int4_awq")
        assert "rebuild it with `spec-edge export --weights int4_awq`" in str(err.value)


def test_config_folds_the_old_quantization_key():
    from spec_edge.config import from_params

    with pytest.raises(ConfigError, match=r"graphs.quantization is gone.*graphs.weights: fp8"):
        from_params({"graphs.quantization": "fp8"})
    trt = {"runtime.backend": "tensorrt", "graphs.dtype": "bfloat16"}
    for form in ("int4_awq", "int4_gguf", "fp8", "nvfp4"):
        assert Config().replace(**{"graphs.weights": form, **trt}).graphs.weights == form
        assert Config().replace(**{"graphs.weights": form}).graphs.weights == form
    with pytest.raises(ConfigError, match="graphs.dtype: float32"):
        Config().replace(**{"graphs.weights": "fp8", "graphs.dtype": "float16", "graphs.ort_attention": "graph"})
    with pytest.raises(ConfigError, match="int4_awq or int4_gguf"):
        Config().replace(**{"graphs.weights": "q4", **trt})
    with pytest.raises(ConfigError, match="graphs.int4_block"):
        Config().replace(**{"graphs.int4_block": 48})


def test_tensorrt_export_writes_the_qdq_graphs_without_a_gpu(small, prompt_file):
    from spec_edge.device import builder, specs

    cfg, folder, _ = small
    cfg = cfg.replace(**{"runtime.backend": "tensorrt", "graphs.dtype": "bfloat16", "graphs.weights": "int4_awq",
                         "runtime.profile": "trt"})  # its own artifact folder: the static export stays
    dirs = builder.export_all(cfg, QUIET)
    target = dirs["target"]
    assert target.name.endswith("_int4_awq")
    assert json.loads((target / "manifest.json").read_text())["weights"] == "int4_awq"
    for stem in json.loads((target / "manifest.json").read_text())["graphs"]:
        assert specs.onnx_quantization(target / f"{stem}.onnx") == "int4"
        graph = onnx.load(str(target / f"{stem}.onnx"), load_external_data=False)
        tokens = next(i for i in graph.graph.input if i.name == io_names.TOKENS)
        assert tokens.type.tensor_type.shape.dim[1].dim_param  # the dynamic T of the shared layout stays
    builder.check_quantization(cfg, specs.engine_specs(cfg, dirs))  # what build checks before TensorRT


def test_plan_counts_the_produced_file(tiny_cfg, tmp_path):
    """Once the Q/DQ folder exists, the memory plan's target weights are its weights.bin, not the estimate."""
    from spec_edge.device import memory, profiles

    cfg = tiny_cfg.replace(**{"runtime.engine_dir": str(tmp_path), "runtime.backend": "tensorrt",
                              "graphs.dtype": "bfloat16", "graphs.weights": "nvfp4", "runtime.profile": "plan"})
    assert profiles.quantized_weights_bytes(cfg) is None  # nothing written yet for this profile
    inputs = profiles.plan_inputs(cfg)
    estimate = memory.weight_bytes(inputs.target, "bfloat16", "nvfp4")
    folder = qdq.folder_for(export.artifact_dir(cfg, "target"), "nvfp4")
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"\0" * 12345)
    (folder / "manifest.json").write_text(json.dumps({"quantization": qdq.wanted_record(cfg, "nvfp4", None)}))
    lines = dict(memory.plan(profiles.plan_inputs(cfg)).lines)
    assert lines["target weights (1 engine, file)"] == 12345 and estimate != 12345
    assert memory.weight_bytes(inputs.target, "bfloat16", "int4_awq") < memory.weight_bytes(
        inputs.target, "bfloat16", "fp8") < memory.weight_bytes(inputs.target, "bfloat16")
