"""What a Thor build needs, checked in seconds before any stage runs (`spec-edge build`) or reported
(`spec-edge plan --device`): one Finding per piece, each missing one saying what to install or set.

Device pieces (the engine stage; `spec-edge build --export-only` needs none of them), found with Edge-LLM's own
detection (tensorrt_edgellm/_native/detect.py, one fact at a time so every missing fact is named, then
select.py's exact payload match against the installed variants.json):
  tensorrt-edgellm   the pinned version is installed
  python / cpu       the interpreter's ABI (cp312 on Thor) and architecture
  platform           the release marker Edge-LLM matches payloads on (L4T release on a Jetson)
  gpu                a CUDA device through the driver (its SM)
  cuda runtime       the libcudart soname
  tensorrt           the libnvinfer soname (Edge-LLM names the tensorrt package to install)
  payload            the one native payload this machine loads, or why none
  memory             the device's available memory against the plan's total
Quantize pieces (graphs.weights nvfp4 / int4_awq / fp8 on an unquantized checkpoint; both modes), looked up in
the interpreter that runs tensorrt-edgellm-quantize (quantize_python()):
  modelopt, datasets, calibration set (EDGELLM_QUANT_DATASET_CNN_DAILYMAIL or the file made from
  data/train_prompts.txt), or a checkpoint already quantized that way, which skips the stage.
Visual export piece (graphs.max_image_tokens; both modes): modelopt in the same interpreter (visual_findings).
No torch anywhere here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spec_edge.config import Config
from spec_edge.device import checkpoint, memory
from spec_edge.edgellm_layout import EDGELLM_VERSION

CALIBRATION_ENV = "EDGELLM_QUANT_DATASET_CNN_DAILYMAIL"  # Edge-LLM's local override of its default text dataset
CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout spec_edge runs from (a build runs from one)
PROMPTS = CHECKOUT / "data" / "train_prompts.txt"  # the calibration text
QUANTIZE_PYTHON_ENV = "SPEC_EDGE_QUANTIZE_PYTHON"
QUANTIZE_VENV = ".venv-quantize"  # scripts/setup.sh --thor-quantize
EXPORT_ONLY = ("`spec-edge build --export-only` runs the stages that need no GPU (plan, checkpoint, quantize, "
               "export) on this machine")


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    text: str  # what was found; when missing, what to install or set

    def line(self) -> str:
        return f"  {'ok' if self.ok else 'MISSING':<7} {self.name}: {self.text}"


def report(findings: list[Finding]) -> str:
    missing = [f for f in findings if not f.ok]
    head = (f"preflight: {len(missing)} of {len(findings)} missing" if missing
            else f"preflight: all {len(findings)} present")
    return "\n".join([head] + [f.line() for f in findings])


def quantize_python() -> str:
    """The interpreter that runs tensorrt-edgellm-quantize: $SPEC_EDGE_QUANTIZE_PYTHON, else the checkout's
    .venv-quantize (scripts/setup.sh --thor-quantize: Edge-LLM's [tools] pins), else this one."""
    if os.environ.get(QUANTIZE_PYTHON_ENV):
        return os.environ[QUANTIZE_PYTHON_ENV]
    venv = CHECKOUT / QUANTIZE_VENV / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def needs_quantize(cfg: Config) -> str | None:
    """The form the quantize stage would make (graphs.weights), or None when there is nothing to quantize (fp32,
    or model.target is a folder already quantized that way)."""
    want = cfg.graphs.weights
    if want == "fp32":
        return None
    target = Path(cfg.model.target).expanduser()
    if target.is_dir() and checkpoint.quantization_of(target) == want:
        return None
    return want


def calibration_source() -> tuple[Path | None, str]:
    """(the calibration file the quantize stage passes, how it was found); None when there is none."""
    if os.environ.get(CALIBRATION_ENV):
        path = Path(os.environ[CALIBRATION_ENV])
        return (path if path.exists() else None), f"${CALIBRATION_ENV}={path}"
    return (PROMPTS if PROMPTS.is_file() else None), str(PROMPTS)


def write_calibration(out: Path, lines_per_text: int = 16) -> Path:
    """A calibration set in the layout Edge-LLM's cnn_dailymail loader reads through its local override (JSONL,
    the text in "article"): data/train_prompts.txt, lines_per_text prompts per text. Returns out."""
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for i in range(0, len(prompts), lines_per_text):
            fh.write(json.dumps({"article": "\n".join(prompts[i:i + lines_per_text])}) + "\n")
    return out


def _modules_in(python: str, names: tuple[str, ...]) -> dict[str, bool] | None:
    """name -> importable in interpreter `python` (found, not imported); None when it does not run."""
    probe = ("import importlib.util as u, json, sys; "
             "print(json.dumps({n: u.find_spec(n) is not None for n in sys.argv[1:]}))")
    if python == sys.executable:
        import importlib.util

        return {n: importlib.util.find_spec(n) is not None for n in names}
    try:
        done = subprocess.run([python, "-c", probe, *names], capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def quantize_findings(cfg: Config) -> list[Finding]:
    want = cfg.graphs.weights
    if want == "fp32":
        return []
    if needs_quantize(cfg) is None:
        return [Finding("quantize", True, f"skipped: model.target {cfg.model.target} is already {want}")]
    python = quantize_python()
    setup = "scripts/setup.sh --thor-quantize (a .venv-quantize with Edge-LLM's [tools] pins)"
    found = _modules_in(python, ("modelopt", "datasets"))
    if found is None:
        return [Finding("quantize python", False, f"{python} does not run: set ${QUANTIZE_PYTHON_ENV} or run {setup}")]
    out = [Finding("modelopt", found["modelopt"], f"NVIDIA ModelOpt in {python}" if found["modelopt"] else
                   f"not in {python}: run {setup}, or pip install nvidia-modelopt==0.45.0 there; or set "
                   f"model.target to a checkpoint already quantized as {want} (skips the stage)"),
           Finding("datasets", found["datasets"], f"in {python}" if found["datasets"] else
                   f"not in {python} (Edge-LLM's calibration loader imports it): run {setup}, or pip install "
                   f"datasets==5.0.0 there")]
    path, where = calibration_source()
    out.append(Finding("calibration set", path is not None,
                       f"{where} (no Hub download)" if path is not None else
                       f"{where} does not exist: point ${CALIBRATION_ENV} at a local JSONL file with an \"article\" "
                       f"field per line, or restore data/train_prompts.txt"))
    return out


def visual_findings(cfg: Config) -> list[Finding]:
    """graphs.max_image_tokens: the visual encoder's export imports NVIDIA ModelOpt even unquantized
    (tensorrt_edgellm/scripts/export.py _export_visual imports ..quantization.quantization_configs, whose package
    imports modelopt: quantization/models/dflash_draft.py), so the target's export runs in quantize_python()."""
    if not cfg.graphs.max_image_tokens:
        return []
    python = quantize_python()
    setup = "scripts/setup.sh --thor-quantize (a .venv-quantize with Edge-LLM's [tools] pins)"
    found = _modules_in(python, ("modelopt",))
    if found is None:
        return [Finding("visual export python", False, f"{python} does not run: set ${QUANTIZE_PYTHON_ENV} or run "
                                                       f"{setup}")]
    return [Finding("modelopt (visual export)", found["modelopt"], f"NVIDIA ModelOpt in {python}" if found["modelopt"]
                    else f"not in {python}: tensorrt-edgellm-export imports it to export the visual encoder "
                         f"(graphs.max_image_tokens={cfg.graphs.max_image_tokens}): run {setup}, or pip install "
                         f"nvidia-modelopt==0.45.0 there; or set graphs.max_image_tokens: 0 (text only)")]


def _tensorrt_soname(detect, jetpack: bool) -> str:
    """detect._find_soname("nvinfer"); on a Jetson its failure names JetPack's own TensorRT instead of Edge-LLM's
    advice to pip install a tensorrt wheel (_native/dependencies.py _INSTALL_GUIDANCE: x86 / DGX Spark packages;
    on JetPack libnvinfer comes with the platform)."""
    from tensorrt_edgellm import _native

    try:
        return detect._find_soname("nvinfer")
    except _native.NativeRuntimeError:
        if not jetpack:
            raise
        raise _native.NativeDetectionError(
            "libnvinfer (TensorRT 10) not found: on a Jetson TensorRT comes with JetPack, not from pip; install "
            "JetPack's components (sudo apt install nvidia-jetpack) and check `ldconfig -p | grep libnvinfer`") from None


def device_findings(cfg: Config, plan: memory.Plan | None) -> list[Finding]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("tensorrt-edgellm")
    except PackageNotFoundError:
        return [Finding("tensorrt-edgellm", False, f"not installed: pip install --no-deps tensorrt-edgellm=="
                                                   f"{EDGELLM_VERSION} (scripts/setup.sh does)")]
    out = [Finding("tensorrt-edgellm", installed == EDGELLM_VERSION, installed if installed == EDGELLM_VERSION else
                   f"{installed} is installed, spec_edge is checked against {EDGELLM_VERSION}: pip install --no-deps "
                   f"tensorrt-edgellm=={EDGELLM_VERSION}")]
    from tensorrt_edgellm import _native
    from tensorrt_edgellm._native import detect, select

    facts: dict[str, object] = {}

    def fact(name: str, key: str, probe, what=lambda v: str(v), fix: str = "") -> None:
        try:
            facts[key] = value = probe()
            out.append(Finding(name, True, what(value)))
        except _native.NativeRuntimeError as err:
            out.append(Finding(name, False, f"{err}{'; ' + fix if fix else ''}"))

    fact("python", "python_abi", detect._python_abi)
    fact("cpu", "cpu_arch", detect._cpu_arch)
    cpu = facts.get("cpu_arch", "x86_64")
    fact("platform", "platform", lambda: detect._platform_probe(cpu), lambda v: f"{v[0]} {v[1]}")

    def gpu() -> int:
        sms = sorted(set(detect._cuda_device_sms()))
        if len(sms) != 1:
            raise _native.NativeDetectionError(f"visible CUDA devices have SMs {sms}: expose one architecture")
        return sms[0]
    fact("gpu", "gpu_sm", gpu, lambda v: f"CUDA device, SM{v}",
         "TensorRT engines are built on the device that runs them (the Thor).")
    fact("cuda runtime", "cuda_runtime_soname", lambda: detect._find_soname("cudart"),
         fix="Install the CUDA runtime (JetPack ships it).")
    jetpack = Path("/etc/nv_tegra_release").is_file()  # what _native/detect.py _l4t_probe reads on a Jetson
    fact("tensorrt", "tensorrt_runtime_soname", lambda: _tensorrt_soname(detect, jetpack))
    manifest = select.load_manifest(Path(detect.__file__).parent / "variants.json")
    rows = [v for v in manifest["variants"] if v["cpu_arch"] == cpu and v["python_abi"] == facts.get("python_abi")]
    names = ", ".join(sorted(v["variant_id"] for v in rows)) or "none"
    if {"python_abi", "cpu_arch", "platform", "gpu_sm", "cuda_runtime_soname", "tensorrt_runtime_soname"} <= set(facts):
        detected = detect.DetectedPlatform(
            python_abi=facts["python_abi"], platform_probe_source=facts["platform"][0],
            platform_probe_value=facts["platform"][1], cpu_arch=cpu, cuda_runtime_soname=facts["cuda_runtime_soname"],
            tensorrt_runtime_soname=facts["tensorrt_runtime_soname"], gpu_sm=facts["gpu_sm"])
        try:
            row = select.select_variant(detected, manifest)
            out.append(Finding("payload", True, row["variant_id"]))
        except _native.NativeRuntimeError as err:
            out.append(Finding("payload", False, str(err)))
    else:
        unknown = [k for k in ("gpu_sm", "platform", "cuda_runtime_soname", "tensorrt_runtime_soname", "python_abi")
                   if k not in facts]
        out.append(Finding("payload", False, f"none for this machine ({', '.join(unknown)} not found); this wheel "
                                             f"ships for {cpu} {facts.get('python_abi', '?')}: {names}. A Thor needs "
                                             f"the aarch64 cp312 wheel on JetPack 7.x"))
    device = memory.read_device_memory()
    if plan is None:
        pass
    elif device is None:
        out.append(Finding("memory", False, f"no device memory to read (no CUDA device, not a Jetson); the plan "
                                            f"needs {plan.total / memory.GIB:.1f} GiB"))
    else:
        fits = plan.total <= device.available
        out.append(Finding("memory", fits, f"{device.available / memory.GIB:.1f} GiB available of "
                                           f"{device.total / memory.GIB:.1f} GiB ({device.source}), the plan needs "
                                           f"{plan.total / memory.GIB:.1f} GiB" +
                           ("" if fits else ": stop other processes, or lower graphs.max_context / batch_slots")))
    return out


def check(cfg: Config, *, device: bool, plan: memory.Plan | None = None) -> list[Finding]:
    """Every finding for a build of cfg: the device pieces when device (the engine stage runs), the quantize
    pieces when graphs.weights asks for a calibration here, ModelOpt for a visual encoder's export."""
    return (device_findings(cfg, plan) if device else []) + quantize_findings(cfg) + visual_findings(cfg)
