"""Where a profile's TensorRT Edge-LLM artifacts live, the manifest that says what they are, and the one
accessor the runtime calls: engine_dirs(cfg).

    <engine_dir>/
      checkpoints/<gguf stem>-<fingerprint>/   the embedded / a .gguf target as a Hugging Face folder (fp16)
      <profile>/                               profile_dir(cfg)
        head/                                  the EAGLE-3 head in the layout Edge-LLM loads (checkpoint.py)
        quantized/                             tensorrt-edgellm-quantize's output (graphs.weights != fp32)
        onnx/target/llm/                       the target's export (--eagle-base with a head)
        onnx/draft/llm/                        the head's export
        onnx/batch/llm/                        batch_slots > 1 with a head: the plain target RequestEngine runs
        engines/eagle3/ or engines/plain/      LLMBuilder's output: spec_base.engine + the draft engine (one
        engines/batch/                         directory, as Edge-LLM's runtime reads them) or the plain engine
        manifest.json                          written after every stage (below)

manifest.json: format, tensorrt_edgellm (version), profile, profile_yaml, config (the artifact-shaping keys),
fingerprints (target and head checkpoints), stages (per stage: what it wrote, relative to the profile dir, the
digest of each file, seconds), builder (the limits the engines were built with) and, once engines are built,
"edgellm": {"engine_dir", "draft_engine_dir", "batch_engine_dir"} relative to the profile dir (None where the
profile has no such engine). A manifest from another tensorrt-edgellm version, another profile or another
config is refused with the command that rebuilds it. Pure file work: no TensorRT, no GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from spec_edge.config import Config, ConfigError, engine_root, to_params

FORMAT = 1
MANIFEST = "manifest.json"
# config keys the artifacts are made for; any difference means a rebuild
IDENTITY_KEYS = ("model.target", "graphs.max_context", "graphs.k_values", "graphs.dtype", "graphs.weights",
                 "graphs.batch_slots", "speculative.drafter", "speculative.eagle3_head")
WHOLE_FILE_LIMIT = 64 << 20  # larger files are digested by size + first and last MiB


class ManifestError(RuntimeError):
    """Artifacts on disk do not match the config (missing, made by another version / profile / config);
    the message names the command that rebuilds them."""


def edgellm_version() -> str:
    from tensorrt_edgellm import __version__
    return str(__version__)


def profile_dir(cfg: Config) -> Path:
    return engine_root(cfg) / cfg.runtime.profile


def identity_config(cfg: Config) -> dict[str, Any]:
    params = to_params(cfg)
    part = {key: params[key] for key in IDENTITY_KEYS}
    if cfg.speculative.drafter != "eagle3":
        part["speculative.eagle3_head"] = None
    return part


def rebuild_command(cfg: Config, manifest: dict[str, Any] | None = None) -> str:
    yaml = (manifest or {}).get("profile_yaml") or cfg.runtime.profile
    return f"spec-edge build {yaml} --force"


def file_digest(path: Path) -> str:
    """sha256 of a file (of its size and first and last MiB above WHOLE_FILE_LIMIT: an ONNX weight file of an
    8B model is 16 GB)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size <= WHOLE_FILE_LIMIT:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f"{size}:".encode() + fh.read(1 << 20))
            fh.seek(size - (1 << 20))
            digest.update(fh.read())
    return digest.hexdigest()


def folder_digests(folder: Path, root: Path) -> dict[str, str]:
    """relative path -> file_digest of every file under folder."""
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)


def check_manifest(cfg: Config, manifest: dict[str, Any] | None, *, version: str | None = None) -> dict[str, Any]:
    """The manifest when it was written by this tensorrt-edgellm version for this profile and config; else
    ManifestError naming the rebuild command. version: None = the installed tensorrt-edgellm's."""
    directory = profile_dir(cfg)
    if manifest is None:
        raise ManifestError(f"nothing built for profile '{cfg.runtime.profile}': {directory / MANIFEST} is missing "
                            f"or unreadable; build it with `spec-edge build {cfg.runtime.profile}`")
    rebuild = f"rebuild with `{rebuild_command(cfg, manifest)}`"
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{directory / MANIFEST} has format {manifest.get('format')}, this version reads "
                            f"{FORMAT} (made by spec_edge's retired TensorRT path?): {rebuild}")
    version = version or edgellm_version()
    if manifest.get("tensorrt_edgellm") != version:
        raise ManifestError(f"{directory} was built by tensorrt-edgellm {manifest.get('tensorrt_edgellm')}, this is "
                            f"{version} (its engine I/O changes between releases): {rebuild}")
    if manifest.get("profile") != cfg.runtime.profile:
        raise ManifestError(f"{directory} holds profile '{manifest.get('profile')}', not '{cfg.runtime.profile}': "
                            f"{rebuild}")
    want, have = identity_config(cfg), manifest.get("config", {})
    diffs = [f"{key}: built for {have.get(key)!r}, config says {want[key]!r}" for key in IDENTITY_KEYS
             if have.get(key) != want[key]]
    if diffs:
        raise ManifestError(f"{directory} was built for a different config (" + "; ".join(diffs) + f"): {rebuild}")
    for role, recorded in manifest.get("fingerprints", {}).items():
        current = _fingerprint(cfg, role)
        if current is not None and current != recorded:
            raise ManifestError(f"the {role} checkpoint changed since {directory} was built (fingerprint {recorded} "
                                f"-> {current}): {rebuild}")
    return manifest


def _fingerprint(cfg: Config, role: str) -> str | None:
    """The current fingerprint of a role's checkpoint; None when it is not on this machine (the engines are)."""
    from spec_edge.graphs import weights
    from spec_edge.heads.eagle3 import head_fingerprint

    try:
        if role == "eagle3":
            path = Path(cfg.speculative.eagle3_head).expanduser()
            return head_fingerprint(path) if path.is_dir() else None
        return weights.fingerprint(cfg.model.target)
    except ConfigError:
        return None


def engine_dirs(cfg: Config) -> tuple[Path, Path | None]:
    """(target engine dir, EAGLE-3 draft engine dir or None) of a built profile, absolute; ManifestError when the
    manifest is stale or the engines are not built (export-only) or missing. With a head both are the same
    directory: Edge-LLM's LLMRuntime reads spec_base + the draft engine from one engine_dir."""
    manifest = check_manifest(cfg, read_manifest(profile_dir(cfg)))
    dirs = _built(cfg, manifest)
    return dirs["engine_dir"], dirs.get("draft_engine_dir")


def batch_engine_dir(cfg: Config) -> Path | None:
    """The plain engine RequestEngine runs when graphs.batch_slots > 1 (the target engine itself when the profile
    has no head; a second engine beside the EAGLE-3 pair when it has one); None when batch_slots == 1."""
    manifest = check_manifest(cfg, read_manifest(profile_dir(cfg)))
    return _built(cfg, manifest).get("batch_engine_dir")


def _built(cfg: Config, manifest: dict[str, Any]) -> dict[str, Path]:
    record = manifest.get("edgellm")
    if not record:
        raise ManifestError(f"profile '{cfg.runtime.profile}' was exported but its engines are not built (export-only "
                            f"run); build them on the device with `spec-edge build {manifest.get('profile_yaml')}`")
    out = {}
    for key, rel in record.items():
        if rel is None:
            continue
        path = profile_dir(cfg) / rel
        if not path.is_dir() or not any(path.glob("*.engine")):
            raise ManifestError(f"engine directory {path} is missing or holds no engine: rebuild with "
                                f"`{rebuild_command(cfg, manifest)}`")
        out[key] = path
    return out


def require_known_weights(cfg: Config) -> None:
    if cfg.runtime.backend != "tensorrt":
        raise ConfigError(f"`spec-edge build` builds TensorRT Edge-LLM engines: profile '{cfg.runtime.profile}' has "
                          f"runtime.backend={cfg.runtime.backend} (ONNX Runtime exports on first use, "
                          f"`spec-edge export`)")
