"""Engine manifests: what each engine on disk is and what it was built from, and the check the
runtime runs before it loads any engine.

    engines/
      timing_trt<version>_sm<cc>.cache   TensorRT timing cache, shared by every profile on this device
      <profile>/                         profile_dir(cfg)
        onnx/target/, onnx/draft/        export.py's graphs (rebuilt only when stale)
        <engine>.engine                  one TensorRT engine per model (layout "shared") or per graph
        manifest.json                    what each engine is, and from what (below); written last

manifest.json: format, profile, identity (sha256 over the engine-shaping config keys and the
checkpoints' fingerprints), config (those keys), precision, k, max_context, batch_slots, TensorRT
version, GPU name + compute capability, build time, and per engine: role, widths, kind of each width,
file size + sha256 + stamp (engine_file.engine_stamp: size and the hash of the first and last MiB), build
key (ONNX hashes + precision + TensorRT + GPU + workspace), TensorRT's context memory, and for a batched
engine "batch" (B) and "rows" (width -> [min, opt, max] rows n of its profile).

check_engines() refuses a missing, corrupted or mismatched engine with the command that rebuilds
it: verify='quick' (what the runtime runs at every start: sizes and stamps, milliseconds) or
verify='full' (the default, what `spec-edge build --check` runs: the sha256 of every byte, about a
minute for an 8B engine on Thor). Pure file work: no tensorrt.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from spec_edge.config import HEAD_DRAFTERS, Config, ConfigError, engine_root
from spec_edge.device.engine_file import engine_stamp
from spec_edge.device.specs import file_sha256

VERIFY = ("quick", "full")  # check_engines(verify=...)

FORMAT_VERSION = 2  # 2: engines of export format 2 (one cache input per layer)
MANIFEST = "manifest.json"
# config keys an engine is built for; any difference means the engine must be rebuilt
IDENTITY_KEYS = ("model.target", "model.draft", "graphs.max_context", "graphs.prefill_chunk",
                 "graphs.k_values", "graphs.dtype", "graphs.weights", "graphs.int4_block", "graphs.calibration",
                 "graphs.layer_skip_layers", "speculative.drafter", "speculative.eagle3_head",
                 "graphs.batch_slots")


class ManifestError(RuntimeError):
    """Engines on disk do not match the config (missing, corrupted or built for something else);
    the message names the command that rebuilds them."""


# ---------------------------------------------------------------------------------------------
# Identity: what an engine is built for


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
    if cfg.speculative.drafter not in HEAD_DRAFTERS:
        part["speculative.eagle3_head"] = None
    if cfg.graphs.batch_slots == 1:  # recorded as None: engines built before the key existed stay valid
        part["graphs.batch_slots"] = None
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
    if cfg.speculative.drafter in HEAD_DRAFTERS:
        out["eagle3"] = role_fingerprint(cfg, "eagle3")
    return out


def role_fingerprint(cfg: Config, role: str) -> str:
    """The fingerprint of the checkpoint a role's engine comes from (ConfigError when it is not here)."""
    from spec_edge.graphs import weights
    if role == "eagle3":
        from spec_edge.heads.eagle3 import head_fingerprint

        path = Path(cfg.speculative.eagle3_head).expanduser()
        if not path.is_dir():
            raise ConfigError(f"EAGLE-3 head folder {path} does not exist")
        return head_fingerprint(path)
    return weights.fingerprint(cfg.model.target if role == "target" else cfg.model.draft)


def precision(cfg: Config) -> str:
    q = cfg.graphs.weights
    return cfg.graphs.dtype if q == "fp32" else f"{q}+{cfg.graphs.dtype}"


# ---------------------------------------------------------------------------------------------
# The manifest on disk


def profile_dir(cfg: Config) -> Path:
    return engine_root(cfg) / cfg.runtime.profile


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


def manifest_header(cfg: Config, fingerprints: dict[str, str], trt_version: str, gpu: dict[str, str]
                    ) -> dict[str, Any]:
    part = identity_config(cfg)
    return {"format": FORMAT_VERSION, "profile": cfg.runtime.profile,
            "identity": model_identity(part, fingerprints), "config": part, "fingerprints": fingerprints,
            "precision": precision(cfg), "k": cfg.speculative.k, "k_values": list(cfg.graphs.k_values),
            "max_context": cfg.graphs.max_context, "prefill_chunk": cfg.graphs.prefill_chunk,
            "batch_slots": cfg.graphs.batch_slots, "tensorrt_version": trt_version, "gpu": gpu, "layout": None,
            "built_at": None, "engines": {}}


def engine_roles_needed(cfg: Config) -> tuple[str, ...]:
    drafter = cfg.speculative.drafter
    return ("target",) + (("draft",) if drafter == "draft" else ()) + (
        ("layerskip",) if drafter == "layerskip" else ()) + (("eagle3",) if drafter in HEAD_DRAFTERS else ())


def check_engines(cfg: Config, *, fingerprints: dict[str, str] | None = None,
                  trt_version: str | None = None, gpu: dict[str, str] | None = None,
                  verify: str = "full") -> dict[str, Any]:
    """The manifest of cfg's engines when every engine is there, intact and built for this config,
    model, TensorRT and GPU; otherwise ManifestError saying what to rebuild.

    fingerprints: the checkpoints' current fingerprints (None: computed when the folders exist,
    skipped for those that do not - the runtime needs only the engines). trt_version / gpu: of
    this machine (None: not compared). verify: 'full' sha256 of every engine file (`spec-edge build
    --check`), 'quick' size + stamp (the runtime at start; an engine recorded without a stamp, by
    an older build, gets the full hash)."""
    if verify not in VERIFY:
        raise ValueError(f"check_engines(verify={verify!r}): use one of {VERIFY}")
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
        for role, recorded in manifest.get("fingerprints", {}).items():
            try:
                fingerprints[role] = role_fingerprint(cfg, role)
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
        full = verify == "full" or not entry.get("stamp")
        if not full and engine_stamp(path) != entry["stamp"]:
            raise ManifestError(f"engine {path} is corrupted (its first/last MiB differ from the manifest's "
                                f"stamp): {rebuild}")
        if full and file_sha256(path) != entry.get("sha256"):
            raise ManifestError(f"engine {path} is corrupted (sha256 differs from the manifest): {rebuild}")
    return manifest
