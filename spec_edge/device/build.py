"""`spec-edge build` and `spec-edge plan`: TensorRT engines from the exported ONNX, with a manifest.

    engines/
      timing_trt<version>_sm<cc>.cache   TensorRT timing cache, shared by every profile on this device
      <profile>/
        onnx/target/, onnx/draft/        export.py's graphs (rebuilt only when stale)
        <engine>.engine                  one TensorRT engine per model (layout "shared") or per graph
        manifest.json                    what each engine is, and from what (below); written last

manifest.json: format, profile, identity (sha256 over the engine-shaping config keys and the
checkpoints' fingerprints), config (those keys), precision, k, max_context, TensorRT version, GPU
name + compute capability, build time, and per engine: role, widths, kind of each width, file size +
sha256, build key (ONNX hashes + precision + TensorRT + GPU + workspace) and TensorRT's context memory.

Order of a build: plan check (memory.py) -> export (export.export_model(dynamic=True): one graph per model
with a dynamic token axis; skipped when up to date) -> for each engine,
build only when its build key or file hash changed -> manifest. The runtime calls check_engines(),
which refuses a missing, corrupted or mismatched engine with the command that rebuilds it.

Everything except build_engine() and gpu_identity() is importable and testable without tensorrt.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spec_edge.graphs import io_names
from spec_edge.device import memory
from spec_edge.config import MODEL_PRESETS, Config, ConfigError, ModelConfig, load

FORMAT_VERSION = 2  # 2: engines of export format 2 (one cache input per layer)
MANIFEST = "manifest.json"
Progress = Callable[[str], None]
# config keys an engine is built for; any difference means the engine must be rebuilt
IDENTITY_KEYS = ("model.target", "model.draft", "graphs.max_context", "graphs.prefill_chunk",
                 "graphs.k_values", "graphs.dtype", "graphs.quantization", "graphs.layer_skip_layers",
                 "speculative.drafter")
HASH_CHUNK = 16 << 20


class BuildError(RuntimeError):
    """An engine cannot be built; the message says why and what to change."""


class ManifestError(RuntimeError):
    """Engines on disk do not match the config (missing, corrupted or built for something else);
    the message names the command that rebuilds them."""


# ---------------------------------------------------------------------------------------------
# Profiles and model configs (no weights needed for a plan)


def resolve_profile(arg: str) -> Path:
    """A profile path, or a name looked up as config/<name>.yaml here, in the source tree, and in
    the installed package share directory."""
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    name = arg if arg.endswith(".yaml") else f"{arg}.yaml"
    candidates = [Path.cwd() / "config" / name, Path(__file__).resolve().parents[2] / "config" / name]
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory("spec_edge")) / "config" / name)
    except Exception:  # ament_index missing or the package not installed: only the local paths apply
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"profile '{arg}' not found (looked for {', '.join(str(c) for c in candidates)})")


def model_config(source: str) -> ModelConfig:
    """The architecture a model source names: a preset name, an HF folder's config.json, or (for a
    folder not downloaded yet) the preset whose published name is the folder's name."""
    if source in MODEL_PRESETS:
        return MODEL_PRESETS[source]
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        from spec_edge.graphs.weights import config_from_hf
        return config_from_hf(json.loads((path / "config.json").read_text()))
    by_name = {m.name.lower(): m for m in MODEL_PRESETS.values()}
    if path.name.lower() in by_name:
        return by_name[path.name.lower()]
    if source == "embedded":
        return MODEL_PRESETS["smollm2-135m"]
    raise ConfigError(f"cannot tell the architecture of '{source}': give a Hugging Face folder with "
                      f"config.json, or a preset ({', '.join(MODEL_PRESETS)})")


def engine_layout() -> str:
    """'shared': one engine per model, one optimization profile per width, over the dynamic-width
    graph export.export_model(dynamic=True) writes (memory.py explains why). engine_specs() still builds one
    engine per graph ('per_graph') when it finds only static graphs."""
    return "shared"


def plan_inputs(cfg: Config, layout: str | None = None, measured_activation: int | None = None
                ) -> memory.PlanInputs:
    drafter = cfg.speculative.drafter
    draft = model_config(cfg.model.draft) if drafter == "draft" else None
    return memory.PlanInputs(target=model_config(cfg.model.target), graphs=cfg.graphs, memory=cfg.memory,
                             drafter=drafter, k=cfg.speculative.k, draft=draft,
                             layout=layout or engine_layout(), measured_activation=measured_activation)


def plan_for_config(cfg: Config, device: memory.DeviceMemory | None = None, layout: str | None = None,
                    measured_activation: int | None = None) -> memory.Plan:
    return memory.plan(plan_inputs(cfg, layout, measured_activation), device)


# ---------------------------------------------------------------------------------------------
# Hashes, identity, manifest (pure file work, no tensorrt)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def quick_fingerprint(path: Path) -> str:
    """Size + first and last MiB: identifies a large file cheaply (ONNX external weights)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        digest.update(fh.read(1 << 20))
        if size > 2 << 20:
            fh.seek(size - (1 << 20))
            digest.update(fh.read())
    return digest.hexdigest()


def identity_config(cfg: Config) -> dict[str, Any]:
    """The engine-shaping config keys; a key the drafter does not use is recorded as None, so
    changing it does not force a rebuild."""
    from spec_edge.config import to_params
    params = to_params(cfg)
    part = {key: params[key] for key in IDENTITY_KEYS}
    if cfg.speculative.drafter != "draft":
        part["model.draft"] = None
    if cfg.speculative.drafter != "layerskip":
        part["graphs.layer_skip_layers"] = None
    return part


def model_identity(config_part: dict[str, Any], fingerprints: dict[str, str]) -> str:
    """sha256 over the engine-shaping config keys and the checkpoints' fingerprints."""
    blob = json.dumps({"config": config_part, "weights": fingerprints}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def checkpoint_fingerprints(cfg: Config) -> dict[str, str]:
    """role -> weights.fingerprint of the checkpoints the engines come from."""
    from spec_edge.graphs import weights
    out = {"target": weights.fingerprint(cfg.model.target)}
    if cfg.speculative.drafter == "draft":
        out["draft"] = weights.fingerprint(cfg.model.draft)
    return out


def precision(cfg: Config) -> str:
    q = cfg.graphs.quantization
    return cfg.graphs.dtype if q == "none" else f"{q}+{cfg.graphs.dtype}"


def profile_dir(cfg: Config) -> Path:
    return Path(os.path.expanduser(cfg.runtime.engine_dir)) / cfg.runtime.profile


def build_command(cfg: Config) -> str:
    return f"spec-edge build <the profile yaml with runtime.profile: {cfg.runtime.profile}>"


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine to build: name (file stem), role, ONNX file, widths and kind of each width."""
    name: str
    role: str            # target | draft | layerskip
    onnx: Path
    widths: tuple[int, ...]
    kinds: dict[int, str]  # width -> prefill | step | verify | layerskip
    dynamic: bool         # one profile per width over a dynamic token axis

    def build_key(self, extra: dict[str, Any]) -> str:
        """sha256 over what the engine is made of: the ONNX graph file, its external weights'
        fingerprints, widths, and `extra` (precision, TensorRT version, GPU, workspace)."""
        parts = {"onnx": file_sha256(self.onnx), "widths": list(self.widths), "dynamic": self.dynamic,
                 "external": {p.name: quick_fingerprint(p) for p in external_data_files(self.onnx)},
                 **extra}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def external_data_files(onnx_path: Path) -> list[Path]:
    """The external-data files an ONNX file points to (read without loading the weights)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    names = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    names.add(entry.value)
    return [onnx_path.parent / name for name in sorted(names)]


def onnx_token_width(onnx_path: Path) -> int | None:
    """The tokens input's width T, or None when the axis is dynamic (a 'shared' layout graph)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    for value in model.graph.input:
        if value.name == io_names.TOKENS:
            dim = value.type.tensor_type.shape.dim[1]
            return dim.dim_value if dim.HasField("dim_value") else None
    raise BuildError(f"{onnx_path} has no '{io_names.TOKENS}' input: not a spec_edge graph")


def onnx_quantization(onnx_path: Path) -> str:
    """'fp8', 'nvfp4' or 'none': what Q/DQ nodes the graph's weights carry (ModelOpt export)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    found = "none"
    fp8 = (onnx.TensorProto.FLOAT8E4M3FN,)
    fp4 = getattr(onnx.TensorProto, "FLOAT4E2M1", -1)
    init_types = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type.startswith("TRT_FP4") or (node.op_type == "DequantizeLinear" and
                                                  init_types.get(node.input[0]) == fp4):
            return "nvfp4"
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "TRT_FP8QuantizeLinear",
                            "TRT_FP8DequantizeLinear"):
            if node.op_type.startswith("TRT_FP8") or init_types.get(node.input[0]) in fp8:
                found = "fp8"
            for attr in node.attribute:
                if attr.name == "output_dtype" and attr.i in fp8:
                    found = "fp8"
    return found


def engine_specs(cfg: Config, onnx_dirs: dict[str, Path]) -> list[EngineSpec]:
    """The engines a profile needs, from the exported graphs in onnx_dirs (role -> folder): one
    engine over a dynamic-width graph when the export has one, else one engine per static graph.
    The layer-skip graph (in the target's folder) is built only for drafter=layerskip."""
    g, drafter = cfg.graphs, cfg.speculative.drafter
    roles = {"target": onnx_dirs["target"]}
    if drafter == "draft":
        roles["draft"] = onnx_dirs["draft"]
    specs: list[EngineSpec] = []
    skip_prefix = f"layerskip{g.layer_skip_layers}_"
    for role, folder in roles.items():
        files = sorted(Path(folder).glob("*.onnx"))
        if not files:
            raise BuildError(f"no ONNX graphs in {folder}: the export did not run")
        groups = {role: [f for f in files if not f.stem.startswith("layerskip")]}
        if role == "target" and drafter == "layerskip":
            groups["layerskip"] = [f for f in files if f.stem.startswith(skip_prefix)]
            if not groups["layerskip"]:
                raise BuildError(f"no {skip_prefix}*.onnx in {folder}: export the layer-skip graph "
                                 f"(graphs.layer_skip_layers={g.layer_skip_layers})")
        for group_role, group in groups.items():
            dynamic = [f for f in group if onnx_token_width(f) is None]
            if dynamic:
                widths = (memory.target_widths(g) if group_role == "target" else
                          memory.draft_widths(g) if group_role == "draft" else (1,))
                kinds = {w: _kind(w, g, group_role) for w in widths}
                name = role if group_role != "layerskip" else f"layerskip{g.layer_skip_layers}"
                specs.append(EngineSpec(name, group_role, dynamic[0], widths, kinds, True))
                continue
            for f in group:
                width = onnx_token_width(f)
                kind = f.stem.split("_")[0] if group_role != "layerskip" else "layerskip"
                specs.append(EngineSpec(f"{role}_{f.stem}", group_role, f, (width,), {width: kind}, False))
    return specs


def _kind(width: int, g, role: str) -> str:
    if role == "layerskip":
        return "layerskip"
    if width == g.prefill_chunk:
        return "prefill"
    return "step" if width == 1 else "verify"


def manifest_header(cfg: Config, fingerprints: dict[str, str], trt_version: str, gpu: dict[str, str]
                    ) -> dict[str, Any]:
    part = identity_config(cfg)
    return {"format": FORMAT_VERSION, "profile": cfg.runtime.profile,
            "identity": model_identity(part, fingerprints), "config": part, "fingerprints": fingerprints,
            "precision": precision(cfg), "k": cfg.speculative.k, "k_values": list(cfg.graphs.k_values),
            "max_context": cfg.graphs.max_context, "prefill_chunk": cfg.graphs.prefill_chunk,
            "tensorrt_version": trt_version, "gpu": gpu, "layout": None, "built_at": None, "engines": {}}


def engine_roles_needed(cfg: Config) -> tuple[str, ...]:
    drafter = cfg.speculative.drafter
    return ("target",) + (("draft",) if drafter == "draft" else ()) + (
        ("layerskip",) if drafter == "layerskip" else ())


def check_engines(cfg: Config, *, fingerprints: dict[str, str] | None = None,
                  trt_version: str | None = None, gpu: dict[str, str] | None = None,
                  verify: str = "full") -> dict[str, Any]:
    """The manifest of cfg's engines when every engine is there, intact and built for this config,
    model, TensorRT and GPU; otherwise ManifestError saying what to rebuild.

    fingerprints: the checkpoints' current fingerprints (None: computed when the folders exist,
    skipped for those that do not - the runtime needs only the engines). trt_version / gpu: of
    this machine (None: not compared). verify: 'full' sha256 of every engine file (~10 s for 16 GB
    on Thor), 'quick' size only."""
    directory = profile_dir(cfg)
    rebuild = f"rebuild with `{build_command(cfg)}`"
    manifest = read_manifest(directory)
    if manifest is None:
        raise ManifestError(f"no engines for profile '{cfg.runtime.profile}': {directory / MANIFEST} is "
                            f"missing or unreadable; build them with `{build_command(cfg)}`")
    if manifest.get("format") != FORMAT_VERSION:
        raise ManifestError(f"{directory / MANIFEST} has format {manifest.get('format')}, this version "
                            f"reads {FORMAT_VERSION}: {rebuild}")
    want = identity_config(cfg)
    have = manifest.get("config", {})
    diffs = [f"{key}: engines have {have.get(key)!r}, config says {want[key]!r}"
             for key in IDENTITY_KEYS if have.get(key) != want[key]]
    if diffs:
        raise ManifestError(f"engines in {directory} were built for a different config ("
                            + "; ".join(diffs) + f"): {rebuild}")
    if fingerprints is None:
        fingerprints = {}
        from spec_edge.graphs import weights
        for role, recorded in manifest.get("fingerprints", {}).items():
            source = cfg.model.target if role == "target" else cfg.model.draft
            try:
                fingerprints[role] = weights.fingerprint(source)
            except ConfigError:
                fingerprints[role] = recorded  # checkpoint not on this machine: trust the record
    for role, current in fingerprints.items():
        recorded = manifest.get("fingerprints", {}).get(role)
        if recorded != current:
            raise ManifestError(f"the {role} checkpoint changed since the engines were built "
                                f"(fingerprint {recorded} -> {current}): {rebuild}")
    if trt_version is not None and manifest.get("tensorrt_version") != trt_version:
        raise ManifestError(f"engines were built with TensorRT {manifest.get('tensorrt_version')}, this is "
                            f"TensorRT {trt_version} (engines are not portable across versions): {rebuild}")
    if gpu is not None and manifest.get("gpu", {}).get("compute_capability") != gpu.get("compute_capability"):
        raise ManifestError(f"engines were built for {manifest.get('gpu')}, this GPU is {gpu}: {rebuild}")
    engines = manifest.get("engines", {})
    for role in engine_roles_needed(cfg):
        if not any(e.get("role") == role for e in engines.values()):
            raise ManifestError(f"the manifest in {directory} has no {role} engine: {rebuild}")
    for name, entry in engines.items():
        path = directory / entry["file"]
        if not path.is_file():
            raise ManifestError(f"engine {path} is missing: {rebuild}")
        if path.stat().st_size != entry.get("size"):
            raise ManifestError(f"engine {path} is corrupted (size {path.stat().st_size}, manifest says "
                                f"{entry.get('size')}): {rebuild}")
        if verify == "full" and file_sha256(path) != entry.get("sha256"):
            raise ManifestError(f"engine {path} is corrupted (sha256 differs from the manifest): {rebuild}")
    return manifest


# ---------------------------------------------------------------------------------------------
# TensorRT (imported lazily)


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as err:
        raise BuildError("TensorRT's Python package is not importable: on Jetson install JetPack's "
                         "python3-libnvinfer (TensorRT 10.x) and create the venv with "
                         "--system-site-packages") from err
    return trt


def gpu_identity() -> dict[str, str]:
    import torch
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device: TensorRT engines are built on the device that runs them")
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}


def timing_cache_path(engine_root: Path, trt_version: str, gpu: dict[str, str]) -> Path:
    cc = gpu["compute_capability"].replace(".", "")
    return Path(engine_root) / f"timing_trt{trt_version}_sm{cc}.cache"


class _Cancel:
    """Set from the SIGINT handler; the progress monitor then asks TensorRT to stop the build."""

    def __init__(self):
        self.event = threading.Event()


def make_progress_monitor(trt, progress: Progress, cancel: _Cancel):
    """An IProgressMonitor that prints nested phases with step counts (at most one line per second
    per phase, plus start and finish) and cancels the build when `cancel` is set."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._depth: dict[str, int] = {}
            self._steps: dict[str, int] = {}
            self._last: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            with self._lock:
                depth = self._depth.get(parent_phase, -1) + 1 if parent_phase else 0
                self._depth[phase_name] = depth
                self._steps[phase_name] = num_steps
                self._last[phase_name] = time.monotonic()
                progress(f"[build] {'  ' * depth}{phase_name} (0/{num_steps})")

        def step_complete(self, phase_name, step):
            with self._lock:
                now = time.monotonic()
                if now - self._last.get(phase_name, 0.0) >= 1.0:
                    self._last[phase_name] = now
                    depth = self._depth.get(phase_name, 0)
                    progress(f"[build] {'  ' * depth}{phase_name} ({step + 1}/{self._steps.get(phase_name, '?')})")
            return not cancel.event.is_set()

        def phase_finish(self, phase_name):
            with self._lock:
                depth = self._depth.pop(phase_name, 0)
                if depth == 0:
                    progress(f"[build] {phase_name} done")
                self._steps.pop(phase_name, None)
                self._last.pop(phase_name, None)

    return Monitor()


def build_engine(spec: EngineSpec, out_path: Path, *, workspace_bytes: int, timing_cache: Path,
                 progress: Progress = print, cancel: _Cancel | None = None) -> dict[str, Any]:
    """Build one engine from spec.onnx (strongly typed: precisions are the ONNX dtypes and Q/DQ
    nodes) and write it to out_path. Returns what the manifest records about TensorRT's memory."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    progress(f"[build] parsing {spec.onnx}")
    if not parser.parse_from_file(str(spec.onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        for error in errors:
            progress(f"[build] ONNX parser: {error}")
        raise BuildError(f"TensorRT cannot parse {spec.onnx} ({len(errors)} errors, first: "
                         f"{errors[0] if errors else '?'}); re-export with `spec-edge export`")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    cached = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(cached)
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        progress(f"[build] timing cache {timing_cache} does not match this device/TensorRT; starting a new one")
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    cancel = cancel or _Cancel()
    monitor = make_progress_monitor(trt, progress, cancel)
    config.progress_monitor = monitor
    profiles: list[int] = []
    if spec.dynamic:
        for width in spec.widths:
            profile = builder.create_optimization_profile()
            for i in range(network.num_inputs):
                tensor = network.get_input(i)
                shape = tuple(width if d < 0 else d for d in tensor.shape)
                profile.set_shape(tensor.name, shape, shape, shape)
            profiles.append(config.add_optimization_profile(profile))
    started = time.monotonic()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        if cancel.event.is_set():
            raise BuildError(f"build of {out_path.name} cancelled")
        raise BuildError(f"TensorRT could not build {out_path.name} from {spec.onnx} (see the errors "
                         f"above; a too small memory.workspace_gb can cause this)")
    tmp = out_path.with_suffix(".engine.tmp")
    with tmp.open("wb") as fh:
        fh.write(memoryview(serialized))
    os.replace(tmp, out_path)
    cache_tmp = timing_cache.with_suffix(".tmp")
    cache_tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))
    os.replace(cache_tmp, timing_cache)
    seconds = round(time.monotonic() - started, 1)
    del serialized, config, parser, network, builder
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(out_path.read_bytes())
    if engine is None:
        raise BuildError(f"the engine just built ({out_path}) does not deserialize")
    per_profile = [context_memory_size(engine, p) for p in range(engine.num_optimization_profiles)]
    progress(f"[build] {out_path.name}: {seconds} s, context memory {max(per_profile, default=0) / 2**20:.0f} MiB")
    by_width = dict(zip(spec.widths, profiles)) if spec.dynamic else {spec.widths[0]: 0}
    return {"build_seconds": seconds, "profiles": {str(w): int(i) for w, i in by_width.items()},
            "context_memory": max(per_profile, default=0)}


def context_memory_size(engine, profile: int) -> int:
    """Bytes of execution-context memory a profile needs (the *_v2 calls are TensorRT >= 10.1)."""
    if hasattr(engine, "get_device_memory_size_for_profile_v2"):
        return int(engine.get_device_memory_size_for_profile_v2(profile))
    if hasattr(engine, "device_memory_size_v2"):
        return int(engine.device_memory_size_v2)
    return int(engine.device_memory_size)


# ---------------------------------------------------------------------------------------------
# The build


def export_all(cfg: Config, progress: Progress) -> dict[str, Path]:
    """Export (or reuse) the ONNX graphs of the target and, for drafter=draft, the draft."""
    from spec_edge.graphs import export
    dynamic = engine_layout() == "shared"
    dirs = {"target": export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress, dynamic)}
    if cfg.speculative.drafter == "draft":
        dirs["draft"] = export.export_model(cfg, "draft", export.artifact_dir(cfg, "draft"), progress, dynamic)
    return dirs


def check_quantization(cfg: Config, specs: Sequence[EngineSpec]) -> None:
    """A quantized profile needs a quantized export: refuse before TensorRT silently builds bf16."""
    want = cfg.graphs.quantization
    for spec in specs:
        if spec.role == "draft":
            continue
        have = onnx_quantization(spec.onnx)
        if have != want:
            raise BuildError(f"graphs.quantization={want} but {spec.onnx} carries {have} weights: "
                             f"export the target through ModelOpt ({want}) first, see docs/tensorrt.md")


def build(cfg: Config, *, progress: Progress = print, force: bool = False,
          device: memory.DeviceMemory | None = None, cancel: _Cancel | None = None) -> dict[str, Any]:
    """Plan check, export, engines, manifest. Returns the manifest."""
    if cfg.runtime.backend != "tensorrt":
        raise ConfigError(f"runtime.backend is {cfg.runtime.backend}: engines are built for "
                          f"runtime.backend: tensorrt profiles")
    the_plan = memory.check(plan_for_config(cfg, device if device is not None else memory.read_device_memory()))
    progress(the_plan.table())
    trt = import_tensorrt()
    gpu = gpu_identity()
    directory = profile_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    onnx_dirs = export_all(cfg, progress)
    specs = engine_specs(cfg, onnx_dirs)
    check_quantization(cfg, specs)
    fingerprints = checkpoint_fingerprints(cfg)
    old = read_manifest(directory) or {}
    manifest = manifest_header(cfg, fingerprints, trt.__version__, gpu)
    manifest["layout"] = "shared" if any(s.dynamic for s in specs) else "per_graph"
    timing = timing_cache_path(directory.parent, trt.__version__, gpu)
    extra = {"precision": precision(cfg), "tensorrt": trt.__version__, "gpu": gpu["compute_capability"],
             "workspace": int(cfg.memory.workspace_gb * memory.GIB)}
    for spec in specs:
        path = directory / f"{spec.name}.engine"
        key = spec.build_key(extra)
        previous = old.get("engines", {}).get(spec.name)
        if (not force and previous and previous.get("build_key") == key and path.is_file()
                and path.stat().st_size == previous.get("size") and file_sha256(path) == previous.get("sha256")):
            progress(f"[build] {spec.name}: up to date")
            manifest["engines"][spec.name] = previous
            continue
        progress(f"[build] {spec.name}: widths {list(spec.widths)} from {spec.onnx.name}")
        info = build_engine(spec, path, workspace_bytes=extra["workspace"], timing_cache=timing,
                            progress=progress, cancel=cancel)
        manifest["engines"][spec.name] = {
            "file": path.name, "role": spec.role, "onnx": str(spec.onnx), "widths": list(spec.widths),
            "kinds": {str(w): k for w, k in spec.kinds.items()}, "dynamic": spec.dynamic,
            "size": path.stat().st_size, "sha256": file_sha256(path), "build_key": key,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info}
    for stale in set(old.get("engines", {})) - set(manifest["engines"]):
        (directory / old["engines"][stale]["file"]).unlink(missing_ok=True)
    manifest["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json_atomic(directory / MANIFEST, manifest)
    report_engine_sizes(cfg, manifest, progress)
    measured = max((e.get("context_memory", 0) for e in manifest["engines"].values()), default=0)
    progress(memory.plan(plan_inputs(cfg, manifest["layout"], measured or None),
                         memory.read_device_memory()).table())
    progress(f"[build] engines for '{cfg.runtime.profile}' in {directory}")
    return manifest


def report_engine_sizes(cfg: Config, manifest: dict[str, Any], progress: Progress) -> list[str]:
    """Compare each role's engine bytes on disk with the weights the plan counted for it and warn
    when TensorRT stored more (e.g. weights duplicated across optimization profiles): the plan
    is then optimistic and `spec-edge plan --layout per_graph` is the safer bound."""
    inputs = plan_inputs(cfg, manifest.get("layout"))
    dtype, quant = cfg.graphs.dtype, cfg.graphs.quantization
    expected = {"target": memory.weight_bytes(inputs.target, dtype, quant),
                "layerskip": memory.weight_bytes(inputs.target, dtype, quant,
                                                 n_layers=cfg.graphs.layer_skip_layers)}
    if inputs.draft is not None:
        expected["draft"] = memory.weight_bytes(inputs.draft, dtype)
    warnings = []
    for role, weights_bytes in expected.items():
        entries = [e for e in manifest["engines"].values() if e["role"] == role]
        if not entries:
            continue
        on_disk = sum(e["size"] for e in entries)
        planned = weights_bytes * (1 if manifest.get("layout") == "shared" else len(entries))
        line = (f"[build] {role} engines: {on_disk / memory.GIB:.2f} GiB on disk, plan counted "
                f"{planned / memory.GIB:.2f} GiB of weights")
        if on_disk > 1.15 * planned:
            line += " - MORE than planned: trust `spec-edge plan --layout per_graph` for this device"
            warnings.append(line)
        progress(line)
    return warnings


# ---------------------------------------------------------------------------------------------
# Command lines (the lead wires these into `spec-edge build|plan` and the ROS executable)


def _load_profile(arg: str, overrides: dict[str, Any]) -> Config:
    cfg = load(resolve_profile(arg))
    return cfg.replace(**overrides) if overrides else cfg


def _without_ros_args(argv: Sequence[str] | None) -> list[str]:
    """argv without the `--ros-args ...` tail `ros2 run` / launch may append."""
    args = list(sys.argv[1:] if argv is None else argv)
    return args[:args.index("--ros-args")] if "--ros-args" in args else args


def plan_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spec-edge plan", description="Print the memory plan of a profile.")
    parser.add_argument("profile", help="profile yaml, or a name in config/ (e.g. thor_llama31_8b_bf16)")
    parser.add_argument("--max-context", type=int, help="plan this graphs.max_context instead")
    parser.add_argument("--k", type=int, help="plan this speculative.k (must be in graphs.k_values)")
    parser.add_argument("--layout", choices=("shared", "per_graph"), help="engine layout (default: what build does)")
    parser.add_argument("--config-only", action="store_true", help="ignore the memory of this machine")
    parser.add_argument("--alpha", type=float,
                        help="draft acceptance rate for the k table (default: the profile's assumed rate, "
                             "0.7 when none; measure it with `spec-edge bench`)")
    args = parser.parse_args(_without_ros_args(argv))
    overrides: dict[str, Any] = {}
    if args.max_context:
        overrides["graphs.max_context"] = args.max_context
    if args.k:
        overrides["speculative.k"] = args.k
    try:
        cfg = _load_profile(args.profile, overrides)
        device = None if args.config_only else memory.read_device_memory()
        the_plan = plan_for_config(cfg, device, args.layout)
    except ConfigError as err:
        print(f"spec-edge plan: {err}", file=sys.stderr)
        return 2
    print(the_plan.table())
    alpha = args.alpha if args.alpha is not None else ASSUMED_ALPHA.get(cfg.runtime.profile, 0.7)
    print(memory.k_table(the_plan.inputs, alpha))
    if not the_plan.fits:
        try:
            memory.check(the_plan)
        except memory.PlanError as err:
            print(str(err).split("\n", 1)[0], file=sys.stderr)
        return 1
    return 0


def build_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spec-edge build",
                                     description="Export and build the TensorRT engines of a profile.")
    parser.add_argument("profile", help="profile yaml, or a name in config/")
    parser.add_argument("--force", action="store_true", help="rebuild every engine")
    parser.add_argument("--engine-dir", help="override runtime.engine_dir")
    parser.add_argument("--check", action="store_true", help="only check the built engines against the profile")
    args = parser.parse_args(_without_ros_args(argv))
    overrides = {"runtime.engine_dir": args.engine_dir} if args.engine_dir else {}
    try:
        cfg = _load_profile(args.profile, overrides)
        if args.check:
            manifest = check_engines(cfg)
            print(f"engines for '{cfg.runtime.profile}' are complete and match the profile "
                  f"({len(manifest['engines'])} engines, TensorRT {manifest['tensorrt_version']})")
            return 0
        cancel = _Cancel()
        if threading.current_thread() is not threading.main_thread():
            build(cfg, force=args.force, cancel=cancel)
            return 0
        # Ctrl-C asks TensorRT to stop at its next step (the monitor returns False) instead of
        # leaving a half-written engine; the engine file is only replaced once complete anyway.
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.event.set())
        try:
            build(cfg, force=args.force, cancel=cancel)
        finally:
            signal.signal(signal.SIGINT, previous)
    except (ConfigError, BuildError, ManifestError) as err:
        print(f"spec-edge build: {err}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# docs/thor_profiles.md and the plan comments of config/thor_*.yaml

# acceptance rates assumed for the k tables until `spec-edge bench` has measured them on the robot
ASSUMED_ALPHA = {"thor_llama31_8b_bf16": 0.75, "thor_llama31_8b_fp8": 0.75, "thor_qwen3_8b_bf16": 0.70,
                 "thor_llama31_8b_layerskip": 0.40}


def profile_report(cfg: Config, alpha: float) -> str:
    """The shared-layout plan, the per-graph total for comparison, and the k table."""
    shared = plan_for_config(cfg, None, "shared")
    per_graph = plan_for_config(cfg, None, "per_graph")
    return (shared.table() + f"\n  (with one engine per static graph instead: total "
            f"{per_graph.total / memory.GIB:.2f} GiB)\n" + memory.k_table(shared.inputs, alpha))


def write_profile_docs(config_dir: Path, doc_path: Path) -> None:
    """Regenerate the `#@plan` comment block of each config/thor_*.yaml and docs/thor_profiles.md."""
    sections = ["# Thor profiles\n",
                "Generated by `spec_edge.device.build.write_profile_docs` from config/thor_*.yaml (memory.py's "
                "arithmetic; acceptance rates are assumptions until `spec-edge bench` measures them). "
                "`spec-edge plan <profile>` prints the same on the robot, with its real free memory.\n",
                "| profile | target + draft | precision | k | max_context | total GiB | largest context | "
                "speed-up at k (assumed alpha) |", "|---|---|---|---|---|---|---|---|"]
    details = []
    for path in sorted(Path(config_dir).glob("thor_*.yaml")):
        cfg = load(path)
        alpha = ASSUMED_ALPHA.get(path.stem, 0.7)
        report = profile_report(cfg, alpha)
        p = plan_for_config(cfg, None, "shared")
        c = memory.draft_cost(p.inputs) or 0.0
        draft = (Path(cfg.model.draft).name if cfg.speculative.drafter == "draft"
                 else f"layer-skip {cfg.graphs.layer_skip_layers}" if cfg.speculative.drafter == "layerskip"
                 else cfg.speculative.drafter)
        sections.append(f"| {path.stem} | {Path(cfg.model.target).name} + {draft} | {precision(cfg)} | "
                        f"{cfg.speculative.k} | {cfg.graphs.max_context} | {p.total / memory.GIB:.1f} | "
                        f"{p.largest_max_context} | {memory.speedup(alpha, cfg.speculative.k, c):.2f}x "
                        f"({alpha}) |")
        details.append(f"\n## {path.stem}\n\n```\n{report}\n```\n")
        text = path.read_text()
        head, sep, body = text.partition("/**:")
        kept = [line for line in head.splitlines() if not line.startswith("#|")]
        block = [line.replace("#@plan", "") for line in kept]
        block = [line for line in block if line] + ["#@plan"] + ["#| " + r for r in report.splitlines()]
        path.write_text("\n".join(block) + "\n" + sep + body)
    doc_path.write_text("\n".join(sections) + "\n" + "".join(details))
