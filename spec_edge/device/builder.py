"""`spec-edge build`'s work: TensorRT engines from the exported ONNX, with a manifest.

Order of a build: plan check (memory.py) -> export (export.export_model(dynamic=True): one graph per model
with a dynamic token axis, + the EAGLE-3 head's graph; graphs.batch_slots > 1: graphs/batch_dynamic.py's
(n, T) graph alone; skipped when up to date; needs no GPU and stops here with --export-only,
export_only()) -> TensorRT and the GPU -> for each engine (specs.engine_specs),
build only when its build key or file hash changed -> manifest (manifest.py). The runtime calls
manifest.check_engines(), which refuses a missing, corrupted or mismatched engine with the command
that rebuilds it.

TensorRT is imported lazily (import_tensorrt); everything except build_engine() and gpu_identity()
runs and is testable without tensorrt.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spec_edge.config import HEAD_DRAFTERS, QDQ_WEIGHTS, Config, ConfigError
from spec_edge.device import head_memory, memory
from spec_edge.device.engine_file import engine_stamp, load_engine
from spec_edge.device.manifest import (MANIFEST, checkpoint_fingerprints, identity_config, manifest_header, precision,
                                       profile_dir, read_manifest, write_json_atomic)
from spec_edge.device.profiles import engine_layout, plan_for_config, plan_inputs
from spec_edge.device.specs import (BuildError, EngineSpec, engine_specs, external_data_files, file_sha256,
                                    onnx_quantization, profile_input_shapes)

Progress = Callable[[str], None]
# The TensorRT members used here on objects of each class (test/test_tensorrt_api.py checks them, and
# every trt.X chain, against the real 10.13 bindings)
TENSORRT_API = {
    "Builder": ("create_network", "create_builder_config", "create_optimization_profile", "build_serialized_network"),
    "INetworkDefinition": ("num_inputs", "get_input"),
    "ITensor": ("shape", "name"),
    "OnnxParser": ("parse_from_file", "num_errors", "get_error"),
    "IBuilderConfig": ("set_memory_pool_limit", "create_timing_cache", "set_timing_cache", "get_timing_cache",
                       "progress_monitor", "add_optimization_profile"),
    "ITimingCache": ("serialize",),
    "IOptimizationProfile": ("set_shape",),
    "ICudaEngine": ("num_optimization_profiles", "get_device_memory_size_for_profile_v2", "device_memory_size_v2",
                    "device_memory_size"),
}  # (the methods Monitor overrides are checked against trt.IProgressMonitor's)
# expressions that always hold that TensorRT class here: every attribute used on them must exist on it
TENSORRT_RECEIVERS = {"builder": "Builder", "network": "INetworkDefinition", "tensor": "ITensor", "parser": "OnnxParser",
                      "config": "IBuilderConfig", "config.get_timing_cache()": "ITimingCache", "profile": "IOptimizationProfile",
                      "engine": "ICudaEngine"}


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


class Cancel:
    """Set from the SIGINT handler; the progress monitor then asks TensorRT to stop the build."""

    def __init__(self):
        self.event = threading.Event()


def make_progress_monitor(trt, progress: Progress, cancel: Cancel):
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
                 progress: Progress = print, cancel: Cancel | None = None) -> dict[str, Any]:
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
    cancel = cancel or Cancel()
    monitor = make_progress_monitor(trt, progress, cancel)
    config.progress_monitor = monitor
    profiles: dict[str, int] = {}
    if spec.dynamic:
        for name, width in spec.profile_shapes():
            profile = builder.create_optimization_profile()
            for i in range(network.num_inputs):  # (n, T) per width when batched (spec.rows), else (1, T)
                tensor = network.get_input(i)
                low, opt, high = profile_input_shapes(spec, width, tensor.name, tuple(tensor.shape))
                profile.set_shape(tensor.name, low, opt, high)
            profiles[name] = config.add_optimization_profile(profile)
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
    engine = load_engine(trt, runtime, out_path)  # streamed: no whole host copy of the engine
    if engine is None:
        raise BuildError(f"the engine just built ({out_path}) does not deserialize")
    per_profile = [context_memory_size(engine, p) for p in range(engine.num_optimization_profiles)]
    progress(f"[build] {out_path.name}: {seconds} s, context memory {max(per_profile, default=0) / 2**20:.0f} MiB")
    by_name = profiles if spec.dynamic else {str(spec.widths[0]): 0}
    return {"build_seconds": seconds, "profiles": {name: int(i) for name, i in by_name.items()},
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
    """Export (or reuse) every ONNX graph the engines are built from: the target (with the layer-skip
    graph; with the hidden states and the embed_table input when a head is configured), for
    drafter=draft the draft, for drafter=eagle3 / hybrid the EAGLE-3 head's dynamic graph."""
    from spec_edge.graphs import export
    dynamic = engine_layout() == "shared"
    if cfg.graphs.batch_slots > 1:  # the (n, T) graph over B cache regions; no draft / layer-skip / head graph
        from spec_edge.graphs import batch_dynamic
        dirs = {"target": batch_dynamic.export_batch_dynamic(cfg, progress)}
    else:
        dirs = {"target": export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress, dynamic)}
    if cfg.graphs.weights in QDQ_WEIGHTS:  # the Q/DQ ONNX TensorRT builds from (graphs/qdq.py, no GPU needed)
        from spec_edge.graphs import qdq
        dirs["target"] = qdq.for_tensorrt(cfg, dirs["target"], progress)
    if cfg.speculative.drafter == "draft":
        dirs["draft"] = export.export_model(cfg, "draft", export.artifact_dir(cfg, "draft"), progress, dynamic)
    if cfg.speculative.drafter in HEAD_DRAFTERS:
        from spec_edge.heads import eagle3_export

        if not dynamic:
            raise BuildError("the EAGLE-3 head engine needs the shared engine layout (one dynamic-width graph)")
        target = export.read_model_config(dirs["target"])
        dirs["eagle3"] = eagle3_export.export_dynamic_head(cfg, cfg.speculative.eagle3_head, target,
                                                           export.artifact_dir(cfg, "eagle3"), progress)
    return dirs


EXPORT_MANIFEST = "manifest.json"  # engines/<profile>/onnx/manifest.json: what TensorRT is given


def write_export_manifest(cfg: Config, onnx_dirs: dict[str, Path], specs: Sequence[EngineSpec]) -> Path:
    """engines/<profile>/onnx/manifest.json: for each engine the ONNX file, its external weights,
    role, widths, the kind of each width and its optimization profiles, and the shared embedding table
    when the target takes one: everything a TensorRT build reads, written by `build --export-only`."""
    from spec_edge.graphs import export

    root = export.artifact_dir(cfg, "target").parent
    engines = {}
    for spec in specs:
        engines[spec.name] = {
            "role": spec.role, "onnx": str(spec.onnx.relative_to(root)), "dynamic": spec.dynamic,
            "external": [str(p.relative_to(root)) for p in external_data_files(spec.onnx)],
            "widths": list(spec.widths), "kinds": {str(w): k for w, k in spec.kinds.items()},
            "profiles": [name for name, _ in spec.profile_shapes()], **batch_record(spec)}
    from spec_edge.graphs import shared_table

    table = shared_table.record(onnx_dirs["target"])
    folder = "target" if cfg.graphs.batch_slots == 1 else f"target_dynamic_b{cfg.graphs.batch_slots}"  # batch_dynamic
    manifest = {"profile": cfg.runtime.profile, "config": identity_config(cfg), "precision": precision(cfg),
                "batch_slots": cfg.graphs.batch_slots,
                "folders": {role: str(Path(d).relative_to(root)) for role, d in onnx_dirs.items()},
                "embed_table": None if table is None else dict(table, file=f"{folder}/{table['file']}"),
                "engines": engines}
    write_json_atomic(root / EXPORT_MANIFEST, manifest)
    return root / EXPORT_MANIFEST


def batch_record(spec: EngineSpec) -> dict[str, Any]:
    """A batched engine's manifest keys: "batch" (B, its cache regions) and "rows" (width -> [min, opt, max] n)."""
    if spec.rows is None:
        return {}
    return {"batch": max(high for _, _, high in spec.rows.values()),
            "rows": {str(w): list(r) for w, r in sorted(spec.rows.items())}}


def check_quantization(cfg: Config, specs: Sequence[EngineSpec]) -> None:
    """A quantized profile needs a quantized export: refuse before TensorRT silently builds bf16."""
    want = {"fp32": "none", "int4_awq": "int4", "int4_gguf": "int4"}.get(cfg.graphs.weights, cfg.graphs.weights)
    for spec in specs:
        if spec.role in ("draft", "eagle3"):  # the draft model and the head stay in graphs.dtype
            continue
        have = onnx_quantization(spec.onnx)
        if have != want:
            raise BuildError(f"graphs.weights={cfg.graphs.weights} but {spec.onnx} carries {have} weights: "
                             f"`spec-edge build <profile> --force` writes the Q/DQ graphs (graphs/qdq.py), "
                             f"see docs/tensorrt.md")


def export_only(cfg: Config, *, progress: Progress = print, device: memory.DeviceMemory | None = None) -> Path:
    """`spec-edge build --export-only`: the plan check, then every ONNX graph TensorRT would be given and
    the export manifest (write_export_manifest); no CUDA, no TensorRT. Returns the manifest's path."""
    onnx_dirs, specs = _plan_and_export(cfg, progress, device)
    path = write_export_manifest(cfg, onnx_dirs, specs)
    for spec in specs:
        progress(f"[export] {spec.name}: {spec.onnx} (profiles {[name for name, _ in spec.profile_shapes()]})")
    progress(f"[export] the ONNX graphs TensorRT builds '{cfg.runtime.profile}' from are in {path.parent} "
             f"(manifest: {path})")
    return path


def _plan_and_export(cfg: Config, progress: Progress, device: memory.DeviceMemory | None
                     ) -> tuple[dict[str, Path], list[EngineSpec]]:
    if cfg.runtime.backend != "tensorrt":
        raise ConfigError(f"runtime.backend is {cfg.runtime.backend}: engines are built for "
                          f"runtime.backend: tensorrt profiles")
    the_plan = memory.check(plan_for_config(cfg, device if device is not None else memory.read_device_memory()))
    progress(the_plan.table())
    onnx_dirs = export_all(cfg, progress)
    specs = engine_specs(cfg, onnx_dirs)
    check_quantization(cfg, specs)
    return onnx_dirs, specs


def build(cfg: Config, *, progress: Progress = print, force: bool = False,
          device: memory.DeviceMemory | None = None, cancel: Cancel | None = None) -> dict[str, Any]:
    """Plan check, export (needs no GPU), then TensorRT: engines, manifest. Returns the manifest."""
    onnx_dirs, specs = _plan_and_export(cfg, progress, device)
    write_export_manifest(cfg, onnx_dirs, specs)
    trt = import_tensorrt()
    gpu = gpu_identity()
    directory = profile_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
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
            manifest["engines"][spec.name] = {**previous, "stamp": engine_stamp(path)}  # older manifests had none
            continue
        progress(f"[build] {spec.name}: widths {list(spec.widths)} from {spec.onnx.name}")
        info = build_engine(spec, path, workspace_bytes=extra["workspace"], timing_cache=timing,
                            progress=progress, cancel=cancel)
        manifest["engines"][spec.name] = {
            "file": path.name, "role": spec.role, "onnx": str(spec.onnx), "widths": list(spec.widths),
            "kinds": {str(w): k for w, k in spec.kinds.items()}, "dynamic": spec.dynamic, **batch_record(spec),
            "size": path.stat().st_size, "sha256": file_sha256(path), "stamp": engine_stamp(path), "build_key": key,
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
    dtype, quant, block = cfg.graphs.dtype, cfg.graphs.weights, cfg.graphs.int4_block
    expected = {"target": memory.weight_bytes(inputs.target, dtype, quant, int4_block=block),
                "layerskip": memory.weight_bytes(inputs.target, dtype, quant, int4_block=block,
                                                 n_layers=cfg.graphs.layer_skip_layers)}
    if inputs.draft is not None:
        expected["draft"] = memory.weight_bytes(inputs.draft, dtype)
    if inputs.head is not None:  # the table is an input of the target graph, the head has its own engine
        expected["target"] -= head_memory.embedding_in_engine(inputs.target, memory.DTYPE_BYTES[dtype])
        expected["eagle3"] = head_memory.head_weight_bytes(inputs.head, memory.DTYPE_BYTES[dtype])
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
