"""Every config/thor_*.yaml plans and goes through `spec-edge build --export-only` (issue 26, 4d), on tiny
random-weight stand-ins with the profile's own options: a Llama-3.1-style target (llama3 rope, untied) or a
Qwen3-style one (q/k norms) saved as a Hugging Face folder, and a tiny EAGLE-3 head in the published SafeAILab
layout (no layer ids, no rope_theta) where the profile has one. A profile whose dtype or options cannot be
exported fails here, not on the robot.

tensorrt-edgellm-quantize needs NVIDIA ModelOpt, `datasets` and calibration data: where graphs.weights asks for
it and they are missing, the build's preflight stops it before any stage runs, with the message a user acts on;
the same profile with graphs.weights fp32 is then exported (once per distinct export: target family, head,
batch engine)."""
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
    return out, root / "engines"


def stand_in_config(path: Path, stand_ins):
    (models, engine_dir) = stand_ins
    cfg = load(path)
    family = "qwen3" if "qwen3" in path.stem else "llama"
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
