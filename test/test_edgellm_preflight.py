"""The Thor preflight (device/preflight.py): what `spec-edge build` checks before its first stage and
`spec-edge plan --device` reports, from Edge-LLM's own detection (tensorrt_edgellm/_native: detect.py, select.py,
variants.json, dependencies.py) and, for quantized profiles, ModelOpt, `datasets` and the calibration set.

This machine (x86-64, no GPU, no TensorRT) has no payload: a full build stops in seconds with the list, before
converting or exporting anything; where a machine can build engines the refusal tests are skipped."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import edgellm_native
from spec_edge.config import load
from spec_edge import edgellm_layout
from spec_edge.device import commands, preflight

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(edgellm_native.package_dir() is None, reason="tensorrt-edgellm is not installed")


@pytest.fixture(scope="module")
def no_device():
    findings = preflight.device_findings(load(ROOT / "config" / "smollm2_trt_eagle3.yaml"), None)
    if all(f.ok for f in findings):
        pytest.skip("this machine can build Edge-LLM engines")
    return findings


def test_full_build_without_a_device_stops_at_once_with_the_list(no_device, tmp_path, capsys):
    started = time.monotonic()
    rc = commands.build_main(["config/smollm2_trt_eagle3.yaml", "--engine-dir", str(tmp_path)])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 1 and elapsed < 30, (rc, elapsed)
    assert "preflight:" in err and "MISSING gpu:" in err and "MISSING payload:" in err
    assert "nothing was converted or exported" in err and "--export-only` runs the stages that need no GPU" in err
    assert len([line for line in err.splitlines() if line.startswith("  MISSING")]) == \
        len([f for f in no_device if not f.ok]) + 1  # + memory (the plan is known in a build)
    assert not (tmp_path / "checkpoints").exists()  # the GGUF was not converted
    cfg = load(ROOT / "config" / "smollm2_trt_eagle3.yaml").replace(**{"runtime.engine_dir": str(tmp_path)})
    assert edgellm_layout.read_manifest(edgellm_layout.profile_dir(cfg)) is None  # no stage ran
    assert list(tmp_path.iterdir()) == []  # and no empty profile folder is left behind


def test_on_a_jetson_a_missing_tensorrt_names_jetpack_not_pip():
    """Edge-LLM's own advice for a missing libnvinfer is a pip tensorrt wheel (_native/dependencies.py); on JetPack
    TensorRT comes with the platform, and the preflight says so there (elsewhere Edge-LLM's message stands)."""
    from tensorrt_edgellm import _native
    from tensorrt_edgellm._native.dependencies import _INSTALL_GUIDANCE

    class Missing:
        @staticmethod
        def _find_soname(library):
            raise _native.TensorRTDependencyError(f"TensorRT is missing. {_INSTALL_GUIDANCE}")

    with pytest.raises(_native.NativeRuntimeError) as jetson:
        preflight._tensorrt_soname(Missing, jetpack=True)
    assert "comes with JetPack" in str(jetson.value) and "pip install" not in str(jetson.value)
    with pytest.raises(_native.NativeRuntimeError, match="tensorrt==10.16.0.72"):
        preflight._tensorrt_soname(Missing, jetpack=False)


def test_plan_device_lists_the_same_and_the_quantize_pieces(no_device, capsys, monkeypatch):
    monkeypatch.delenv(preflight.CALIBRATION_ENV, raising=False)
    monkeypatch.setenv(preflight.QUANTIZE_PYTHON_ENV, sys.executable)  # the shared venv: no ModelOpt here
    assert commands.plan_main(["config/smollm2_trt_eagle3.yaml", "--device"]) == 1
    plain = capsys.readouterr().out
    assert "MISSING payload:" in plain and "modelopt" not in plain
    assert commands.plan_main(["config/thor_llama31_8b_eagle3_nvfp4.yaml", "--device"]) == 1
    quantized = capsys.readouterr().out
    lines = {line.split(":")[0].split()[-1]: line for line in quantized.splitlines() if line.startswith("  ")}
    assert "MISSING payload" in lines["payload"]
    if importlib_missing("modelopt"):
        assert "MISSING" in lines["modelopt"] and "--thor-quantize" in lines["modelopt"]
    if importlib_missing("datasets"):
        assert "MISSING" in lines["datasets"] and "datasets==5.0.0" in lines["datasets"]
    assert lines["set"].startswith("  ok") and "train_prompts.txt" in lines["set"]  # calibration set


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_a_checkpoint_quantized_that_way_skips_the_quantize_pieces(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    cfg = load(ROOT / "config" / "thor_llama31_8b_eagle3_nvfp4.yaml").replace(**{"model.target": str(tmp_path)})
    [finding] = preflight.quantize_findings(cfg)
    assert finding.ok and "already nvfp4" in finding.text
    fp8 = cfg.replace(**{"graphs.weights": "fp8"})
    assert {f.name for f in preflight.quantize_findings(fp8)} >= {"modelopt", "datasets", "calibration set"}


def test_calibration_set_is_what_edgellms_loader_reads(tmp_path, monkeypatch):
    """The file the quantize stage passes through EDGELLM_QUANT_DATASET_CNN_DAILYMAIL: Edge-LLM's override of its
    default text dataset (datasets/__init__.py local_override_path) finds it, and its cnn_dailymail generator
    (datasets/builtin.py) yields our prompts from the rows a JSON load gives (the loading itself is `datasets`',
    not installed here)."""
    edge_datasets, builtin = _edgellm_datasets()
    out = preflight.write_calibration(tmp_path / "calibration.jsonl")
    monkeypatch.setenv(preflight.CALIBRATION_ENV, str(out))
    assert edge_datasets.local_override_path(edge_datasets.DEFAULT_TEXT_DATASET) == str(out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    monkeypatch.setattr(builtin, "load_hf_split", lambda *a, **k: rows)
    texts = list(builtin.cnn_dailymail())
    assert len(texts) == len(rows) >= 512 // 2 and "Explain the immune system in simple terms." in texts[0]
    assert preflight.calibration_source() == (out, f"${preflight.CALIBRATION_ENV}={out}")


def _edgellm_datasets():
    """The wheel's tensorrt_edgellm/quantization/datasets package and its builtin module, loaded from their files
    (the quantization package's __init__ imports ModelOpt, not installed here)."""
    import importlib.util

    folder = edgellm_native.package_dir() / "quantization" / "datasets"
    spec = importlib.util.spec_from_file_location("edgellm_calibration_datasets", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return package, importlib.import_module(f"{spec.name}.builtin")


def test_the_preflight_imports_no_torch():
    code = ("import sys; from spec_edge.config import load; from spec_edge.device import preflight; "
            "preflight.check(load('config/thor_llama31_8b_eagle3_nvfp4.yaml'), device=True); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_thor_check_sh_builds_the_8b_profile_from_llama_and_llama_head(tmp_path):
    """scripts/thor_check.sh with LLAMA / LLAMA_HEAD elsewhere than the profile's /models paths: the 8B profile it
    runs is the committed one with those two paths (written under $OUT/profiles, same profile name); its preflight
    stage lists it (and stops here at the first profile's MISSING pieces, as on any machine without a device)."""
    llama, head, out = tmp_path / "llama", tmp_path / "head", tmp_path / "out"
    for folder in (llama, head):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    done = subprocess.run(["bash", "scripts/thor_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STAGES": "preflight", "OUT": str(out), "LLAMA": str(llama),
                               "LLAMA_HEAD": str(head), "PYTHONPATH": str(ROOT)})
    written = out / "profiles" / "thor_llama31_8b_eagle3.yaml"
    assert f"== thor_llama31_8b_eagle3: target {llama}, head {head} ({written})" in done.stdout, done.stdout[-3000:]
    cfg, committed = load(written), load(ROOT / "config" / "thor_llama31_8b_eagle3.yaml")
    assert (cfg.model.target, cfg.speculative.eagle3_head) == (str(llama), str(head))
    assert cfg.replace(**{"model.target": committed.model.target,
                          "speculative.eagle3_head": committed.speculative.eagle3_head}) == committed
    assert done.returncode == 1 and "MISSING" in (out / "preflight_smollm2_trt_eagle3.txt").read_text()
