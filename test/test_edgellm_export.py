"""`spec-edge build --export-only` of the embedded default through TensorRT Edge-LLM (issue 26, 4a): the real
GGUF -> Hugging Face conversion and the real tensorrt-edgellm-export of config/smollm2_trt_eagle3.yaml (the
committed EAGLE-3 head): the files, the 30 AttentionPlugin nodes, the configs Edge-LLM's builder reads, the
manifest, its reuse and the refusals of engine_dirs(). The profile without a head (config/smollm2_trt.yaml)
runs the same stages less the head's; its target export (engine role llm, spec_decode_type none) is checked on
a stand-in in test_edgellm_profiles.py (thor_llama31_8b_batch4), which saves a second export of the real model."""
import json
import shutil
from pathlib import Path

import onnx
import pytest

from spec_edge.config import load
from spec_edge import edgellm_layout
from spec_edge.device import edgellm_build

pytestmark = pytest.mark.release
ROOT = Path(__file__).resolve().parents[1]
PROFILE = "config/smollm2_trt_eagle3.yaml"
LLM_FILES = {"config.json", "model.onnx", "model.onnx.data", "embedding.safetensors", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, monkeypatch_module):
    """(cfg, manifest, log lines) of the profile exported once."""
    monkeypatch_module.chdir(ROOT)  # the head path in the profile is relative to the repository root
    cfg = load(ROOT / PROFILE).replace(**{"runtime.engine_dir": str(tmp_path_factory.mktemp("edgellm"))})
    lines: list[str] = []
    manifest = edgellm_build.build(cfg, PROFILE, export_only=True, progress=lines.append)
    return cfg, manifest, lines


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def attention_plugins(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(node.op_type == "AttentionPlugin" for node in model.graph.node)


def test_export_target_files_and_config(exported):
    cfg, manifest, lines = exported
    llm = edgellm_layout.profile_dir(cfg) / "onnx" / "target" / "llm"
    assert LLM_FILES <= {p.name for p in llm.iterdir()}
    assert attention_plugins(llm / "model.onnx") == 30
    config = json.loads((llm / "config.json").read_text())
    assert (config["spec_decode_type"], config["engine_role"], config["num_hidden_layers"]) == ("eagle3", "base", 30)
    assert config["edgellm_version"] == manifest["tensorrt_edgellm"] == edgellm_layout.edgellm_version()
    assert config["kv_cache_dtype"] == "fp16"
    assert any(line.startswith("[export +") and "target:" in line for line in lines)


def test_eagle3_export_target_and_head(exported):
    cfg, manifest, _ = exported
    onnx_dir = edgellm_layout.profile_dir(cfg) / "onnx"
    base = json.loads((onnx_dir / "target" / "llm" / "config.json").read_text())
    assert base["eagle_hidden_state_layers"] == [2, 15, 27]  # = the outputs of layers 1, 14, 26 the head reads
    assert attention_plugins(onnx_dir / "target" / "llm" / "model.onnx") == 30
    draft = json.loads((onnx_dir / "draft" / "llm" / "config.json").read_text())
    assert (draft["engine_role"], draft["draft_vocab_size"], draft["base_model_hidden_size"]) == ("draft", 4096, 3 * 576)
    assert draft["rope_theta"] == 100000.0  # the head's own theta, read from the rewritten folder
    assert {"model.onnx", "model.onnx.data", "d2t.safetensors"} <= {p.name for p in (onnx_dir / "draft" / "llm").iterdir()}
    assert attention_plugins(onnx_dir / "draft" / "llm" / "model.onnx") == 1
    assert set(manifest["stages"]) == {"checkpoint", "head", "export_target", "export_draft"}
    files = manifest["stages"]["export_draft"]["files"]
    assert files["onnx/draft/llm/model.onnx"] == edgellm_layout.file_digest(onnx_dir / "draft" / "llm" / "model.onnx")
    assert manifest["edgellm"] is None and manifest["profile_yaml"] == PROFILE
    assert manifest["config"]["speculative.eagle3_head"] == "heads/smollm2-135m-eagle3"


def test_second_run_reuses_and_a_changed_output_is_stale(exported):
    cfg, manifest, _ = exported
    lines: list[str] = []
    for _ in range(2):  # a reused stage keeps its record: the run after it reuses it again
        lines.clear()
        edgellm_build.build(cfg, PROFILE, export_only=True, progress=lines.append)
        assert any("target: up to date" in line for line in lines)
    stages = edgellm_build.Stages(cfg, PROFILE, lines.append, force=False)
    key = manifest["stages"]["export_target"]["key"]
    assert stages.reuse("export_target", key) is not None
    assert stages.reuse("export_target", "another key") is None
    path = edgellm_layout.profile_dir(cfg) / "onnx" / "target" / "llm" / "tokenizer_config.json"
    text = path.read_text()
    path.write_text(text + " ")
    try:
        assert stages.reuse("export_target", key) is None  # a changed output: the stage runs again
    finally:
        path.write_text(text)


def test_engine_dirs_refuse_export_only_and_other_versions(exported):
    cfg, manifest, _ = exported
    with pytest.raises(edgellm_layout.ManifestError, match="engines are not built.*spec-edge build "
                                                           "config/smollm2_trt_eagle3.yaml"):
        edgellm_layout.engine_dirs(cfg)
    profile = edgellm_layout.profile_dir(cfg)
    other = dict(manifest, tensorrt_edgellm="0.10.0")
    with pytest.raises(edgellm_layout.ManifestError, match=r"tensorrt-edgellm 0.10.0, this is 0.11.0.*`spec-edge "
                                                           r"build config/smollm2_trt_eagle3.yaml --force`"):
        edgellm_layout.check_manifest(cfg, other)
    with pytest.raises(edgellm_layout.ManifestError, match="holds profile 'smollm2-135m-edgellm'"):
        edgellm_layout.check_manifest(cfg, dict(manifest, profile="smollm2-135m-edgellm"))
    with pytest.raises(edgellm_layout.ManifestError, match="the eagle3 checkpoint changed since"):
        edgellm_layout.check_manifest(cfg, dict(manifest, fingerprints=dict(manifest["fingerprints"], eagle3="0" * 16)))
    with pytest.raises(edgellm_layout.ManifestError, match="graphs.max_context: built for 1024, config says 2048"):
        edgellm_layout.check_manifest(cfg.replace(**{"graphs.max_context": 2048}), manifest)
    # a built profile (every file edgellm_layout says the engine stage leaves): the engine dirs the runtime gets,
    # relative to the profile dir in the manifest; one without its draft engine is refused
    for rel, content in edgellm_layout.engine_files(cfg).items():
        (profile / rel).parent.mkdir(parents=True, exist_ok=True)
        (profile / rel).write_text(json.dumps(content) if content is not None else "stand-in")
    edgellm_layout.write_manifest(profile, dict(manifest, edgellm=edgellm_layout.engine_record(cfg)))
    engines = profile / "engines" / "eagle3"
    try:
        assert edgellm_layout.engine_dirs(cfg) == (engines, engines)
        assert edgellm_layout.batch_engine_dir(cfg) is None
        (engines / "spec_draft.engine").unlink()
        with pytest.raises(edgellm_layout.ManifestError, match="lacks spec_draft.engine: rebuild"):
            edgellm_layout.engine_dirs(cfg)
    finally:
        edgellm_layout.write_manifest(profile, manifest)
        shutil.rmtree(profile / "engines")
