"""Every config/thor_*.yaml plans and goes through `spec-edge build --export-only` (issue 26, 4d), on tiny
random-weight stand-ins with the profile's own options: a Llama-3.1-style target (llama3 rope, untied) or a
Qwen3-style one (q/k norms) saved as a Hugging Face folder, and a tiny EAGLE-3 head in the published SafeAILab
layout (no layer ids, no rope_theta) where the profile has one. A profile whose dtype or options cannot be
exported fails here, not on the robot.

tensorrt-edgellm-quantize needs NVIDIA ModelOpt, `datasets` and calibration data: where graphs.weights asks for
it and they are missing, the build's preflight stops it before any stage runs, with the message a user acts on;
the same profile with graphs.weights fp32 is then exported (once per distinct export: target family, head,
batch engine). A VLM profile (graphs.max_image_tokens, a Qwen2.5-VL target) exports its visual encoder through
the same tool, which imports ModelOpt even unquantized: without it the preflight stops the build naming it (a
tiny Qwen2.5-VL config.json is the stand-in: the plan and the preflight read no weights); with it, a tiny
random Qwen2.5-VL made by transformers is exported and its visual/ folder recorded."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spec_edge.config import load
from spec_edge import edgellm_layout
from spec_edge.device import edgellm_build, memory, preflight
from spec_edge.device.profiles import plan_for_config

ROOT = Path(__file__).resolve().parents[1]
THOR = sorted((ROOT / "config").glob("thor_*.yaml"))


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """family -> (tiny target folder, tiny head folder)."""
    from tiny import head_inputs, make_checkpoint, train_tokenizer

    from spec_edge.heads.eagle3 import save_head
    from spec_edge_training.eagle3 import head_config_for, init_state

    root = tmp_path_factory.mktemp("thor_stand_ins")
    tok = train_tokenizer()
    out = {}
    for family, options in {"llama": {"llama3_rope": True}, "qwen3": {"model_type": "qwen3"}}.items():
        target = make_checkpoint(root / family, seed=3, n_layers=8, tokenizer=tok, **options)
        target_cfg, state, draft_ids = head_inputs(target, seed=4, draft_vocab=64)
        hcfg = head_config_for(target_cfg, 64)
        head = save_head(root / f"{family}_head", hcfg, init_state(hcfg, state, draft_ids), draft_ids)
        raw = json.loads((head / "config.json").read_text())  # the published SafeAILab layout: no layer ids,
        for key in ("eagle_config", "spec_edge", "rope_theta", "rope_scaling"):  # no theta (10000 is meant)
            raw.pop(key, None)
        (head / "config.json").write_text(json.dumps(raw))
        out[family] = (target, head)
    vl = root / "qwen25vl"  # config.json only: what the plan and the preflight read
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps(TINY_QWEN25VL))
    out["qwen25vl"] = (vl, None)
    return out, root / "engines"


# a tiny Qwen2.5-VL config.json (the published layout: text keys at the root, vision_config, the image token ids)
TINY_QWEN25VL = {
    "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], "vocab_size": 325,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_start_token_id": 320, "vision_end_token_id": 321, "image_token_id": 323, "video_token_id": 324,
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                      "fullatt_block_indexes": [1], "in_chans": 3}}


def _tiny_qwen25vl(path: Path) -> Path:
    """TINY_QWEN25VL with random fp16 weights (transformers), a tokenizer holding its image tokens."""
    import torch
    from tiny import train_tokenizer
    from tokenizers import AddedToken
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")])
    assert tok.token_to_id("<|image_pad|>") == TINY_QWEN25VL["image_token_id"]
    raw = {k: v for k, v in TINY_QWEN25VL.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**raw)).to(torch.float16).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48, 0.46, 0.41],
        "image_std": [0.27, 0.26, 0.28]}))
    return path


def stand_in_config(path: Path, stand_ins):
    (models, engine_dir) = stand_ins
    cfg = load(path)
    family = "qwen25vl" if "qwen25vl" in path.stem else "qwen3" if "qwen3" in path.stem else "llama"
    target, head = models[family]
    return cfg.replace(**{"model.target": str(target), "runtime.engine_dir": str(engine_dir),
                          "speculative.eagle3_head": str(head) if cfg.speculative.drafter == "eagle3" else ""})


def test_thor_profiles_plan_as_published():
    assert {p.stem for p in THOR} >= {"thor_llama31_8b_eagle3_nvfp4", "thor_llama31_8b_eagle3_int4",
                                      "thor_llama31_8b_eagle3_fp8"}
    for path in THOR:
        cfg = load(path)
        assert (cfg.runtime.backend, cfg.graphs.dtype) == ("tensorrt", "float16"), path.name
        p = memory.check(plan_for_config(cfg))  # the published architectures (device/presets.py)
        assert p.largest_max_context >= cfg.graphs.max_context, path.name


EXPORTED: set[tuple] = set()


@pytest.mark.parametrize("path", THOR, ids=[p.stem for p in THOR])
def test_thor_profile_export_only_on_stand_ins(path, stand_ins, monkeypatch):
    monkeypatch.setenv(preflight.QUANTIZE_PYTHON_ENV, sys.executable)  # quantize here, not in a .venv-quantize
    cfg = stand_in_config(path, stand_ins)
    assert memory.check(plan_for_config(cfg)).fits
    lines: list[str] = []
    if cfg.graphs.weights != "fp32" and importlib.util.find_spec("modelopt") is None:
        with pytest.raises(edgellm_build.BuildError, match=r"(?s)preflight: .*MISSING modelopt: .*--thor-quantize.*"
                                                           rf"already quantized as {cfg.graphs.weights}.*nothing was "
                                                           r"converted or exported"):
            edgellm_build.build(cfg, str(path), export_only=True, progress=lines.append)
        assert edgellm_layout.read_manifest(edgellm_layout.profile_dir(cfg)) is None  # stopped before any stage
        cfg = cfg.replace(**{"graphs.weights": "fp32"})
    if cfg.graphs.max_image_tokens and importlib.util.find_spec("modelopt") is None:
        with pytest.raises(edgellm_build.BuildError, match=r"(?s)preflight: .*MISSING modelopt \(visual export\): "
                                                           r"not in .*exports? the visual encoder.*--thor-quantize.*"
                                                           r"graphs.max_image_tokens: 0.*nothing was converted"):
            edgellm_build.build(cfg, str(path), export_only=True, progress=lines.append)
        assert edgellm_layout.read_manifest(edgellm_layout.profile_dir(cfg)) is None  # stopped before any stage
        return  # the export needs ModelOpt (not installed here): docs/tensorrt.md says what was not run
    if cfg.graphs.max_image_tokens:  # ModelOpt is here: a tiny Qwen2.5-VL with weights, exported for real
        cfg = cfg.replace(**{"model.target": str(_tiny_qwen25vl(Path(cfg.model.target).parent / "qwen25vl_weights"))})
    shape = (Path(cfg.model.target).name, cfg.speculative.drafter, cfg.graphs.batch_slots > 1)
    if shape in EXPORTED:
        return  # the same export as an earlier profile: its refusal above was the check
    EXPORTED.add(shape)
    manifest = edgellm_build.build(cfg, str(path), export_only=True, progress=lines.append)
    onnx_dir = edgellm_layout.profile_dir(cfg) / "onnx"
    roles = {"target"} | ({"draft"} if cfg.speculative.drafter == "eagle3" else set()) | (
        {"batch"} if cfg.speculative.drafter == "eagle3" and cfg.graphs.batch_slots > 1 else set())
    assert {f"export_{r}" for r in roles} <= set(manifest["stages"])
    for role in roles:
        config = json.loads((onnx_dir / role / "llm" / "config.json").read_text())
        assert config["kv_cache_dtype"] == "fp16"
        assert config["engine_role"] == {"target": "base" if "draft" in roles else "llm", "draft": "draft",
                                         "batch": "llm"}[role]
    if cfg.graphs.max_image_tokens:  # the visual encoder beside the LLM, recorded, with what QwenViTRunner reads
        visual = json.loads((onnx_dir / "target" / "visual" / "config.json").read_text())
        assert visual["model_type"] == "qwen2_5_vl" and visual["image_token_id"] == TINY_QWEN25VL["image_token_id"]
        assert manifest["stages"]["export_target"]["outputs"]["visual"] == "onnx/target/visual"
    target = json.loads((onnx_dir / "target" / "llm" / "config.json").read_text())
    assert target["spec_decode_type"] == ("eagle3" if "draft" in roles else "none")  # the head-less path
    assert ("head" in manifest["stages"]) == ("export_draft" in manifest["stages"]) == ("draft" in roles)
    limits = edgellm_layout.builder_limits(cfg)
    folder = limits["engines/eagle3" if "draft" in roles else "engines/plain"]
    assert all(fields["max_input_len"] == cfg.graphs.max_context for fields in folder.values())
    if "draft" in roles:  # every k's accept-token step (k + 1) and Edge-LLM's default tree (test_edgellm_layout.py)
        assert folder["draft"]["max_draft_tree_size"] >= max(cfg.graphs.k_values) + 1
        assert folder["base"]["max_verify_tree_size"] >= max(cfg.graphs.k_values) + 1
    else:
        assert folder["llm"]["max_batch_size"] == cfg.graphs.batch_slots


def test_the_visual_engine_stage_builds_into_the_bundle_root(tmp_path):
    """graphs.max_image_tokens: the engine stage's VisualBuilder (the stand-in, checked against the binary's
    signatures and settable fields) gets the exported visual/ folder, <LLM engine folder>/visual and
    edgellm_layout.visual_limits; the stage is recorded apart from the LLM engine's, reused while its inputs and
    outputs hold, and the runtime's reader finds what it wrote (backends/edgellm_visual.visual_engine)."""
    from edgellm_standin import Script, build

    from spec_edge.runtime.backends.edgellm_visual import visual_engine

    cfg = load(ROOT / "config" / "thor_qwen25vl_3b.yaml").replace(**{"runtime.engine_dir": str(tmp_path)})
    lines: list[str] = []
    st = edgellm_build.Stages(cfg, "thor_qwen25vl_3b.yaml", lines.append, force=False)
    visual_onnx = st.dir / "onnx" / "target" / "visual"
    visual_onnx.mkdir(parents=True)
    (visual_onnx / "config.json").write_text(json.dumps({  # what _export_visual writes for a Qwen2.5-VL
        "model_type": "qwen2_5_vl", "vision_config": TINY_QWEN25VL["vision_config"],
        **{k: TINY_QWEN25VL[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id")}}))
    st.manifest["stages"]["export_target"] = {"key": "exported"}
    script = Script()
    native = build(script)
    edgellm_build.build_visual(st, native, {"visual": visual_onnx}, "base")
    [(onnx_dir, engine_dir, fields)] = script.visual_builds
    folder = edgellm_layout.engine_record(cfg)["visual_engine_dir"]
    assert folder == "engines/plain/visual" and engine_dir == str(st.dir / folder) and onnx_dir == str(visual_onnx)
    assert fields == edgellm_layout.visual_limits(cfg) == {"min_image_tokens": 4, "max_image_tokens": 1024,
                                                            "max_image_tokens_per_image": 512}
    assert st.manifest["stages"]["engine_visual"]["outputs"] == {"engine_dir": folder}
    st.old = json.loads((st.dir / edgellm_layout.MANIFEST).read_text())  # a second run reads the manifest
    edgellm_build.build_visual(st, native, {"visual": visual_onnx}, "base")
    assert len(script.visual_builds) == 1 and "visual: up to date" in lines[-1]
    st.manifest["edgellm"] = edgellm_layout.engine_record(cfg)
    (st.dir / "engines" / "plain" / "llm.engine").touch()  # the LLM engine the manifest names (empty, as the visual)
    edgellm_layout.write_manifest(st.dir, {**st.manifest, "config": edgellm_layout.identity_config(cfg)})
    engine = visual_engine(cfg, "rebuild")
    assert (engine.engine_dir, engine.images, engine.tokens_per_image) == (st.dir / folder, 2, 512)
    assert engine.span_ids == (320, 323, 321)
