"""`spec-edge build PROFILE`: a profile's TensorRT Edge-LLM engines, stage by stage, with progress and a manifest.

  1 plan       memory.check(the profile's plan): refuse what does not fit before anything runs, then the
               preflight (preflight.py): without --export-only everything the engine stage needs (Edge-LLM's native
               payload for this machine, GPU, CUDA / TensorRT libraries, free memory), and for a quantized profile
               ModelOpt, `datasets` and a calibration set; a missing piece stops the build here, in seconds
  2 checkpoint the target as a Hugging Face folder (checkpoint.hf_folder; the embedded GGUF converted once, ~20 s)
               and, with drafter eagle3, the head rewritten in the layout Edge-LLM loads (checkpoint.py)
  3 quantize   graphs.weights nvfp4 | int4_awq | fp8 on an unquantized checkpoint: tensorrt-edgellm-quantize
               (ModelOpt calibration) in preflight.quantize_python(), on the GPU when the CUDA driver sees one, with
               the calibration set made from data/train_prompts.txt (or $EDGELLM_QUANT_DATASET_CNN_DAILYMAIL): no Hub
               download. A checkpoint already quantized that way skips it; one quantized another way is refused.
  4 export     tensorrt-edgellm-export: the target (--eagle-base with a head), the head, and with graphs.batch_slots
               > 1 and a head the plain target the RequestEngine runs. With graphs.max_image_tokens the target's
               export also writes its visual encoder (onnx/target/visual: the export does for every VLM model type,
               scripts/export.py _has_visual / _export_visual; the other exports pass --skip-visual). No GPU:
               `--export-only` stops here.
  5 engines    on the device, tensorrt_edgellm's LLMBuilder(onnx_dir, engine_dir, LLMBuilderConfig) with
               edgellm_layout.builder_limits (the plan's limits; with a head, tree room for every k, the
               speculative.eagle3_tree and Edge-LLM's default tree); with graphs.max_image_tokens VisualBuilder(
               onnx/target/visual, <target engine folder>/visual, VisualBuilderConfig) with
               edgellm_layout.visual_limits.

A stage whose inputs (config identity, checkpoint fingerprints, tensorrt-edgellm version) match the manifest's
record and whose outputs are still there with the recorded digests is skipped ("up to date").
The Edge-LLM tools run as subprocesses (their own logging, a clean exit status); the native runtime is imported
only in stage 5.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spec_edge.config import Config, engine_root
from spec_edge.device import checkpoint, memory, preflight
from spec_edge.edgellm_layout import (FORMAT, MANIFEST, VISION_MODEL_TYPES, VISUAL_FOLDER, builder_limits,
                                      edgellm_version,
                                      engine_record, file_digest, folder_digests, identity_config, profile_dir,
                                      read_manifest, require_known_weights, visual_limits, write_manifest)
from spec_edge.device.profiles import plan_for_config, plan_inputs

Progress = Callable[[str], None]


CPU_CALIBRATION_SAMPLES = 16  # calibration texts on a machine without a CUDA device (Edge-LLM's default: 512)


class BuildError(RuntimeError):
    """A stage failed; the message says which and what to do."""


def _tool(name: str, python: str = sys.executable) -> list[str]:
    """A tensorrt-edgellm console script of an interpreter's environment (run as `python -m`, so the venv's own
    package is used even when its bin/ is not on PATH)."""
    return [python, "-m", f"tensorrt_edgellm.scripts.{name}"]


def _run(cmd: list[str], stage: str, progress: Progress, log: Path, env: dict[str, str] | None = None) -> None:
    """Run an Edge-LLM tool, its output into log (the last lines are shown when it fails)."""
    progress(f"[{stage}] $ {' '.join(cmd[2:]) if cmd[1:2] == ['-m'] else ' '.join(cmd)}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        result = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"{stage} failed (exit {result.returncode}); the end of {log}:\n{tail}")


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class Stages:
    """The state of one build: the config, the manifest being written, progress with elapsed times."""

    def __init__(self, cfg: Config, profile_yaml: str, progress: Progress, force: bool):
        self.cfg, self.progress, self.force = cfg, progress, force
        self.dir = profile_dir(cfg)  # made by build() once the plan and the preflight passed
        old = read_manifest(self.dir) or {}
        self.old = old if old.get("format") == FORMAT and old.get("tensorrt_edgellm") == edgellm_version() else {}
        self.started = time.monotonic()
        self.manifest: dict[str, Any] = {
            "format": FORMAT, "tensorrt_edgellm": edgellm_version(), "profile": cfg.runtime.profile,
            "profile_yaml": profile_yaml, "config": identity_config(cfg), "fingerprints": {}, "stages": {},
            "builder": None, "edgellm": None}

    def say(self, stage: str, text: str) -> None:
        self.progress(f"[{stage} +{time.monotonic() - self.started:.0f}s] {text}")

    def reuse(self, stage: str, key: str) -> dict[str, Any] | None:
        """The old record of a stage when its key matches and its outputs are intact."""
        record = self.old.get("stages", {}).get(stage)
        if self.force or not record or record.get("key") != key:
            return None
        for rel, digest in record.get("files", {}).items():
            path = self.dir / rel
            if not path.is_file() or file_digest(path) != digest:
                return None
        return record

    def record(self, stage: str, key: str, outputs: dict[str, str], seconds: float, exclude: str = "",
               **extra: Any) -> dict[str, Any]:
        """exclude: a folder (relative to the profile dir) inside an output that another stage records."""
        files: dict[str, str] = {}
        for rel in outputs.values():
            if rel is not None and (self.dir / rel).is_dir():
                files.update(folder_digests(self.dir / rel, self.dir))
        if exclude:
            files = {k: v for k, v in files.items() if not k.startswith(exclude.rstrip("/") + "/")}
        entry = {"key": key, "outputs": outputs, "files": files, "seconds": round(seconds, 1), **extra}
        self.manifest["stages"][stage] = entry
        write_manifest(self.dir, self.manifest)
        return entry


def build(cfg: Config, profile_yaml: str, *, export_only: bool = False, force: bool = False,
          progress: Progress = print) -> dict[str, Any]:
    """Run the stages (1-4; 5 unless export_only) and return the manifest."""
    require_known_weights(cfg)
    st = Stages(cfg, profile_yaml, progress, force)
    existed = st.dir.is_dir()
    try:
        return _stages(st, cfg, profile_yaml, export_only)
    except BaseException:  # a refused or stopped build leaves no empty profile folder behind
        if not existed and st.dir.is_dir() and not any(st.dir.iterdir()):
            st.dir.rmdir()
        raise


def _stages(st: Stages, cfg: Config, profile_yaml: str, export_only: bool) -> dict[str, Any]:
    # 1 plan
    device = None if export_only else memory.read_device_memory()
    the_plan = memory.check(plan_for_config(cfg, device))
    st.say("plan", f"fits: {the_plan.total / memory.GIB:.2f} GiB of {the_plan.device / memory.GIB:.2f} GiB "
                   f"({the_plan.device_source}); largest max_context {the_plan.largest_max_context}")
    findings = preflight.check(cfg, device=not export_only, plan=the_plan)
    if not all(f.ok for f in findings):
        raise BuildError(preflight.report(findings) + "\nnothing was converted or exported" +
                         ("" if export_only else f"; {preflight.EXPORT_ONLY}"))
    if findings:
        st.say("preflight", preflight.report(findings))
    st.dir.mkdir(parents=True, exist_ok=True)
    inputs = plan_inputs(cfg)
    head = cfg.speculative.drafter == "eagle3"
    # 2 checkpoint
    t = time.monotonic()
    target_src = checkpoint.hf_folder(cfg.model.target, engine_root(cfg) / "checkpoints")
    require_vision(cfg, target_src)
    st.manifest["stages"]["checkpoint"] = {"target": str(target_src), "seconds": round(time.monotonic() - t, 1)}
    from spec_edge.graphs import weights
    from spec_edge.heads.eagle3 import head_fingerprint

    st.manifest["fingerprints"] = {"target": weights.fingerprint(cfg.model.target)}
    if head:
        st.manifest["fingerprints"]["eagle3"] = head_fingerprint(cfg.speculative.eagle3_head)
    base_key = _key(st.manifest["config"], st.manifest["fingerprints"], edgellm_version())
    head_dir = None
    if head:
        t = time.monotonic()
        head_dir = st.dir / "head"
        if st.reuse("head", base_key) is None:
            checkpoint.edgellm_head_folder(cfg.speculative.eagle3_head, inputs.target, head_dir)
        st.record("head", base_key, {"head": "head"}, time.monotonic() - t)
    write_manifest(st.dir, st.manifest)
    st.say("checkpoint", f"target {target_src}" + (f", head {head_dir}" if head_dir else ""))
    # 3 quantize
    source = quantize(st, target_src, base_key)
    # 4 export
    exports = export(st, source, head_dir, base_key)
    if export_only:
        st.say("export", f"export-only: ONNX in {st.dir / 'onnx'}; the engines are built on the device with "
                         f"`spec-edge build {profile_yaml}`")
        return st.manifest
    # 5 engines
    build_engines(st, exports, base_key)
    return st.manifest


def require_vision(cfg: Config, target: Path) -> None:
    """BuildError unless graphs.max_image_tokens is 0 or the target is a Qwen-VL checkpoint (its config.json
    model_type in edgellm_layout.VISION_MODEL_TYPES: the VLMs whose images this project sends)."""
    if not cfg.graphs.max_image_tokens:
        return
    try:
        model_type = json.loads((target / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if model_type not in VISION_MODEL_TYPES:
        raise BuildError(f"graphs.max_image_tokens={cfg.graphs.max_image_tokens} builds Edge-LLM's visual engine, but "
                         f"model.target {target} is model_type '{model_type}', not a Qwen-VL checkpoint "
                         f"({', '.join(VISION_MODEL_TYPES)}): point model.target at one, or set graphs.max_image_tokens: 0")


def quantize(st: Stages, source: Path, base_key: str) -> Path:
    want = st.cfg.graphs.weights
    have = checkpoint.quantization_of(source)
    if want == "fp32":
        if have is not None:
            raise BuildError(f"model.target {source} is quantized ({have}) but graphs.weights is fp32: set "
                             f"graphs.weights: {have}")
        return source
    if have == want:
        st.say("quantize", f"skipped: {source} is already {want} (the fast path)")
        return source
    if have is not None:
        raise BuildError(f"model.target {source} is quantized as {have}, graphs.weights asks for {want}: point "
                         f"model.target at the unquantized checkpoint or set graphs.weights: {have}")
    out = st.dir / "quantized"
    if (record := st.reuse("quantize", base_key)) is not None:
        st.say("quantize", f"up to date ({out}, made in {record['seconds']} s)")
        st.manifest["stages"]["quantize"] = record
        write_manifest(st.dir, st.manifest)
        return out
    from tensorrt_edgellm._native import NativeRuntimeError, detect

    try:
        on = "cuda" if detect._cuda_device_sms() else "cpu"
    except NativeRuntimeError:
        on = "cpu"
    samples = []  # Edge-LLM's default count (512) on the GPU
    if on == "cpu":
        samples = ["--num_samples", str(CPU_CALIBRATION_SAMPLES)]
        st.say("quantize", f"no CUDA device: calibrating {want} on the CPU with {CPU_CALIBRATION_SAMPLES} texts (the "
                           f"135M model, fp8: about 11 min on 2 busy cores, docs/tensorrt.md; an 8B model: hours)")
    calibration, where = preflight.calibration_source()
    if preflight.CALIBRATION_ENV not in os.environ:
        calibration = preflight.write_calibration(st.dir / "calibration" / "train_prompts.jsonl")
    shutil.rmtree(out, ignore_errors=True)
    t = time.monotonic()
    _run(_tool("quantize", preflight.quantize_python()) + [
        "llm", "--model_dir", str(source), "--output_dir", str(out), "--quantization", want, "--device", on, *samples],
        "quantize", st.progress, st.dir / "logs" / "quantize.log",
        env={preflight.CALIBRATION_ENV: str(calibration), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    st.record("quantize", base_key, {"checkpoint": "quantized"}, time.monotonic() - t, device=on,
              calibration=where)
    st.say("quantize", f"{want} checkpoint in {out} ({time.monotonic() - t:.0f} s on {on}, calibrated on {where})")
    return out


def export(st: Stages, source: Path, head_dir: Path | None, base_key: str) -> dict[str, Path]:
    """role -> exported ONNX folder (the `llm/` folder Edge-LLM writes under each output root; "visual": the target's
    visual/ folder when graphs.max_image_tokens)."""
    vision = visual_limits(st.cfg) is not None
    jobs: dict[str, list[str]] = {}
    if head_dir is None:
        jobs["target"] = [str(source)]
    else:
        jobs["target"] = [str(source), "--eagle-base"]
        jobs["draft"] = [str(head_dir)]
        if st.cfg.graphs.batch_slots > 1:
            jobs["batch"] = [str(source), "--skip-visual"] if vision else [str(source)]
    out: dict[str, Path] = {}
    for role, args in jobs.items():
        root = st.dir / "onnx" / role
        stage = f"export_{role}"
        key = _key(base_key, args[1:], str(st.manifest["stages"].get("quantize", {}).get("key")))
        if (record := st.reuse(stage, key)) is not None:
            st.manifest["stages"][stage] = record
            st.say("export", f"{role}: up to date ({root}, exported in {record['seconds']} s)")
        else:
            shutil.rmtree(root, ignore_errors=True)
            t = time.monotonic()
            python = preflight.quantize_python() if vision and role == "target" else sys.executable  # ModelOpt
            _run(_tool("export", python) + [args[0], str(root)] + args[1:], "export", st.progress,
                 st.dir / "logs" / f"export_{role}.log")
            llm, visual = root / "llm", (root / "visual" if vision and role == "target" else None)
            for folder in (llm, visual):
                if folder is not None and not (folder / "model.onnx").is_file():
                    raise BuildError(f"tensorrt-edgellm-export wrote no {folder / 'model.onnx'} (see "
                                     f"{st.dir / 'logs'})")
            outputs = {"onnx": f"onnx/{role}/llm"} | ({"visual": f"onnx/{role}/visual"} if visual else {})
            st.record(stage, key, outputs, time.monotonic() - t)
            st.say("export", f"{role}: {llm}" + (f" and {visual}" if visual else "") +
                   f" in {time.monotonic() - t:.0f} s")
        out[role] = root / "llm"
        if vision and role == "target":
            out["visual"] = root / "visual"
    write_manifest(st.dir, st.manifest)  # the reused records too: the next run reads them
    return out


def build_engine(st: Stages, stage: str, key: str, what: str, rel: str, source: Path, builder, config_type,
                 fields: dict, exclude: str = "") -> None:
    """One engine stage: reused when its key matches, else builder(source, <st.dir>/rel, config_type with fields)
    built and recorded (what: how the messages name it)."""
    if (record := st.reuse(stage, key)) is not None:
        st.manifest["stages"][stage] = record
        st.say("engines", f"{what}: up to date ({st.dir / rel})")
        return
    config = config_type()
    for name, value in fields.items():
        setattr(config, name, value)
    engine_dir = st.dir / rel
    engine_dir.mkdir(parents=True, exist_ok=True)
    st.say("engines", f"{what}: building from {source} into {engine_dir} ({fields})")
    t = time.monotonic()
    if not builder(str(source), str(engine_dir), config).build():
        raise BuildError(f"{builder.__name__} could not build the {what} engine from {source} (see TensorRT's "
                         f"messages above)")
    st.record(stage, key, {"engine_dir": rel}, time.monotonic() - t, exclude=exclude)
    st.say("engines", f"{what}: built in {time.monotonic() - t:.0f} s")


def build_visual(st: Stages, native, exports: dict[str, Path], base_key: str) -> None:
    """graphs.max_image_tokens: VisualBuilder(onnx/target/visual, <target engine folder>/visual, VisualBuilderConfig)
    with edgellm_layout.visual_limits (it writes visual.engine and the export's config.json + builder_config,
    cpp/builder/visualBuilder.cpp VisualBuilder::build)."""
    if (fields := visual_limits(st.cfg)) is not None:
        key = _key(base_key, st.manifest["stages"]["export_target"]["key"], fields)
        build_engine(st, "engine_visual", key, "visual", engine_record(st.cfg)["visual_engine_dir"],
                     exports["visual"], native.VisualBuilder, native.VisualBuilderConfig, fields)


def build_engines(st: Stages, exports: dict[str, Path], base_key: str) -> None:
    try:
        from tensorrt_edgellm import runtime as edgellm_runtime
        native = edgellm_runtime.load()
    except Exception as err:  # the wheel's native payload: NativeRuntimeError and its kinds
        raise BuildError(f"tensorrt-edgellm's native runtime does not load here ({err}): `spec-edge plan --device "
                         f"<profile>` lists what this machine lacks") from err
    limits = builder_limits(st.cfg)
    st.manifest["builder"] = limits
    # (folder, Edge-LLM role) -> the export it is built from, and the stage that records it
    sources = {("engines/eagle3", "base"): "target", ("engines/eagle3", "draft"): "draft",
               ("engines/plain", "llm"): "target", ("engines/batch", "llm"): "batch"}
    for rel, roles in limits.items():
        for role, fields in roles.items():
            export = sources[rel, role]
            key = _key(base_key, st.manifest["stages"][f"export_{export}"]["key"], fields)
            build_engine(st, f"engine_{export}", key, role, rel, exports[export], native.LLMBuilder,
                         native.LLMBuilderConfig, fields,
                         exclude=f"{rel}/{VISUAL_FOLDER}")  # the visual engine's own stage records that
    build_visual(st, native, exports, base_key)
    st.manifest["edgellm"] = engine_record(st.cfg)
    st.manifest["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_manifest(st.dir, st.manifest)
    st.say("engines", f"engines for '{st.cfg.runtime.profile}' in {st.dir} ({MANIFEST})")

