"""Where a profile's TensorRT Edge-LLM artifacts live, the manifest that says what they are, and the one
accessor the runtime calls: engine_dirs(cfg). Beside device/ (it imports config, graphs and heads): `spec-edge
build` (device/) writes what it describes, the runtime (runtime/backends/edgellm.py) reads it; neither imports the
other.

    <engine_dir>/
      checkpoints/<gguf stem>-<fingerprint>/   the embedded / a .gguf target as a Hugging Face folder (fp16)
      <profile>/                               profile_dir(cfg)
        head/                                  the EAGLE-3 head in the layout Edge-LLM loads (checkpoint.py)
        quantized/                             tensorrt-edgellm-quantize's output (graphs.weights != fp32)
        onnx/target/llm/                       the target's export (--eagle-base with a head)
        onnx/draft/llm/                        the head's export
        onnx/batch/llm/                        batch_slots > 1 with a head: the plain target RequestEngine runs
        onnx/target/visual/                    graphs.max_image_tokens > 0: the visual encoder the same export wrote
        engines/eagle3/                        LLMBuilder's EAGLE-3 pair in one folder, as LLMRuntime reads it:
                                                 spec_base.engine + base_config.json,
                                                 spec_draft.engine + draft_config.json
        engines/plain/, engines/batch/         a plain engine: llm.engine + config.json (batch: the RequestEngine's)
        engines/<plain|eagle3>/visual/         graphs.max_image_tokens > 0: VisualBuilder's visual.engine + config.json
                                                 in the target engine's folder, the bundle root the runtime's
                                                 multimodal_engine_dir names (the wheel's experimental/server/runtime/
                                                 engine_layout.py inspect_bundle: <root>/visual/visual.engine,
                                                 BundleLayout.media_dir = the root)
        manifest.json                          written after every stage (below)

Edge-LLM's own names, the one place this project spells them (ENGINE_FILE, CONFIG_FILE, BUILDER_CONFIG; roles
llm / base / draft as Edge-LLM calls them): LLMBuilder writes <role engine> and <role config> = the exported
config.json plus "builder_config" (LLMBuilderConfig.toJson) into the engine folder; the runtime and the wheel's
readers (scripts/sweep_eagle3_configs.py _read_engine_limits, experimental/server/runtime/engine.py and
engine_layout.py) read the same names. builder_limits(cfg) is what each engine is built with; engine_files(cfg) is
every file those builds leave (what test fixtures are made from); tree_problems() is Edge-LLM's deployment check of
an EAGLE-3 drafting shape against the built limits.

manifest.json: format, tensorrt_edgellm (version), profile, profile_yaml, config (the artifact-shaping keys),
fingerprints (target and head checkpoints), stages (per stage: what it wrote, relative to the profile dir, the
digest of each file, seconds), builder (the limits the engines were built with) and, once engines are built,
"edgellm": {"engine_dir", "draft_engine_dir", "batch_engine_dir", "visual_engine_dir"} relative to the profile
dir (None where the profile has no such engine). A manifest from another tensorrt-edgellm version, another profile or another
config is refused with the command that rebuilds it. Pure file work: no TensorRT, no GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spec_edge.config import Config, ConfigError, engine_root, to_params

EDGELLM_VERSION = "0.11.0"  # the tensorrt-edgellm (pip package) this project is checked against
FORMAT = 1
MANIFEST = "manifest.json"
# config keys the artifacts are made for; any difference means a rebuild
IDENTITY_KEYS = ("model.target", "graphs.max_context", "graphs.k_values", "graphs.dtype", "graphs.weights",
                 "graphs.batch_slots", "speculative.drafter", "speculative.eagle3_head", "graphs.max_image_tokens")
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
    if not cfg.graphs.max_image_tokens:  # text only: what a manifest written before images were served says
        part["graphs.max_image_tokens"] = None
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


def visual_engine_dir(cfg: Config) -> Path | None:
    """The visual engine folder of a built profile (graphs.max_image_tokens > 0), absolute; None for a text-only
    profile; ManifestError as engine_dirs."""
    manifest = check_manifest(cfg, read_manifest(profile_dir(cfg)))
    return _built(cfg, manifest).get("visual_engine_dir")


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
        missing = [ENGINE_FILE[role] for role in ENGINE_FOLDERS.get(rel, ())
                   if not (path / ENGINE_FILE[role]).is_file()]
        if rel not in ENGINE_FOLDERS or missing:
            raise ManifestError(f"engine directory {path} lacks {', '.join(missing) or 'its engines'}: rebuild with "
                                f"`{rebuild_command(cfg, manifest)}`")
        out[key] = path
    return out


def require_known_weights(cfg: Config) -> None:
    if cfg.runtime.backend != "tensorrt":
        raise ConfigError(f"`spec-edge build` builds TensorRT Edge-LLM engines: profile '{cfg.runtime.profile}' has "
                          f"runtime.backend={cfg.runtime.backend} (ONNX Runtime exports on first use, "
                          f"`spec-edge export`)")


# -- Edge-LLM's engine folder ---------------------------------------------------------------------------
# role -> the file LLMBuilder writes (llmBuilder.cpp getEngineFileName / getOutputConfigFileName, single rank; the
# runtime's modelArtifacts.cpp and the wheel's experimental/server/runtime/engine_layout.py read the same names)
ENGINE_FILE = {"llm": "llm.engine", "base": "spec_base.engine", "draft": "spec_draft.engine"}
CONFIG_FILE = {"llm": "config.json", "base": "base_config.json", "draft": "draft_config.json"}
# the visual role: VisualBuilder::build writes visual.engine and copyConfig the export's config.json + builder_config
# (cpp/builder/visualBuilder.cpp); QwenViTRunner::validateAndFillConfig reads that config.json back
ENGINE_FILE["visual"], CONFIG_FILE["visual"] = "visual.engine", "config.json"
BUILDER_CONFIG = "builder_config"  # the key LLMBuilder::copyConfig adds: LLMBuilderConfig.toJson()
ROLE_FLAG = {"llm": None, "base": "spec_base", "draft": "spec_draft"}  # the LLMBuilderConfig flag of each role
# folder (relative to profile_dir) -> the roles LLMBuilder builds into it; manifest "edgellm" key of each folder
ENGINE_FOLDERS = {"engines/eagle3": ("base", "draft"), "engines/plain": ("llm",), "engines/batch": ("llm",),
                  "engines/eagle3/visual": ("visual",), "engines/plain/visual": ("visual",)}
VISUAL_FOLDER = "visual"  # the visual engine's folder inside the bundle root (engine_layout.py _component_dir)
# The Qwen-VL family (model_type of the checkpoint's config.json) whose images this project sends: tensorrt-edgellm-
# export writes their visual encoder to <out>/visual (scripts/export.py _VLM_MODEL_TYPES, _export_visual) and the
# runtime's QwenViTRunner (cpp/multimodal/qwen2/qwenViTRunner.cpp) expands each <|image_pad|> of the prompt text
# (textPreprocess) after a <|vision_start|> (getMRopePositionIds). Edge-LLM's other VLMs (InternVL, Phi-4MM, Gemma4,
# Nemotron-Omni) mark images their own ways: refused here until wired.
VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
# VisualBuilderConfig's defaults in the 0.11.0 binary (fixtures/edgellm_api.json "defaults"): the fewest tokens
# one image becomes and the most one image may become (qwenSmartResize's bounds, QwenViTRunner::getResizedImageSize)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS_PER_IMAGE = 4, 512
# Edge-LLM's default EAGLE-3 drafting shape (experimental/server/runtime/engine.py _DEFAULT_DRAFT_TOP_K,
# _DEFAULT_DRAFT_STEP, _DEFAULT_VERIFY_TREE_SIZE) and LLMBuilderConfig's default tree capacity
# (max_verify_tree_size = max_draft_tree_size = 60, llmBuilder.h; the binary's defaults in fixtures/edgellm_api.json)
DEFAULT_TREE_CAPACITY = 60
# NVIDIA's EAGLE-3 sweep (tensorrt_edgellm/scripts/sweep_eagle3_configs.py _DEFAULT_TOP_KS, _DEFAULT_DRAFT_STEPS; its
# _generate_combos pairs each with verify sizes up to the base's max_verify_tree_size): its widest proposal,
# 12 x 8 = 96 draft tokens, is the draft engine's room, so every combination it generates runs on our engines
SWEEP_TOP_KS, SWEEP_DRAFT_STEPS = (6, 8, 10, 12), (4, 6, 8)
SWEEP_DRAFT_CAPACITY = max(SWEEP_TOP_KS) * max(SWEEP_DRAFT_STEPS)


@dataclass(frozen=True)
class EagleTree:
    """An EAGLE-3 drafting shape as LLMRuntime takes it: draft_top_k, draft_step, verify_tree_size."""
    top_k: int
    steps: int
    verify_size: int

    def draft_tokens(self) -> int:
        """The widest draft-engine call: the proposal (steps x top_k tokens) or the accept-token step (up to
        steps + 1 accepted tokens, EagleDecoder::runDraftModelAcceptToken)."""
        return max(self.steps * self.top_k, self.steps + 1)


DEFAULT_TREE = EagleTree(top_k=10, steps=6, verify_size=60)


def eagle3_tree(cfg: Config) -> EagleTree:
    """speculative.eagle3_tree ([top_k, steps, verify_size]) or, when empty, the chain of speculative.k."""
    tree = cfg.speculative.eagle3_tree
    k = cfg.speculative.k
    return EagleTree(*tree) if tree else EagleTree(1, k, k + 1)


def candidate_nodes(tree: EagleTree) -> int:
    """The nodes Edge-LLM's EAGLE-3 drafting scores, the verify tree's candidates: the root, top_k children, then
    top_k x top_k per further step (cpp/runtime/decoding/eagleDecoder.cpp EagleDecoder::EagleDecoder
    draftFullTableLength = 1 + draftTopK + (draftingStep - 1) x draftTopK^2; constructDraftProposal picks the
    verifySize best of them with selectAllTopK)."""
    return 1 + tree.top_k + (tree.steps - 1) * tree.top_k ** 2


def tree_problems(tree: EagleTree, base: dict[str, Any], draft: dict[str, Any]) -> list[str]:
    """What Edge-LLM refuses (or fails on) when `tree` is served by engines built with these builder_config
    values; [] when it runs. Each check is Edge-LLM's, for EAGLE-3:
      - draft_step x draft_top_k <= the draft engine's max_draft_tree_size, and verify_tree_size <= the base's
        max_verify_tree_size (cpp/runtime/config/llmEngineConfig.cpp createDeploymentConfig; its messages, quoted,
        are in the 0.11.0 binary);
      - every field >= 1 (createDeploymentConfig requirePositiveField);
      - verify_tree_size <= candidate_nodes(tree) (eagleDecoder.cpp: the verify tree is picked from that table);
      - the accept-token step's draft_step + 1 tokens within the draft engine's profile (EagleDecoder::
        runDraftModelAcceptToken feeds up to draftingStep + 1 accepted tokens through the draft engine, whose
        profile LLMBuilder sizes by max_draft_tree_size).
    The wheel's server checks a tree size against [top_k + 1, max] (experimental/server/runtime/engine.py
    _resolve_tree_size) for MTP engines only; for EAGLE-3 it passes verify_tree_size through, so that is not a
    check here."""
    out = []
    max_draft, max_verify = int(draft["max_draft_tree_size"]), int(base["max_verify_tree_size"])
    if min(tree.top_k, tree.steps, tree.verify_size) < 1:
        out.append(f"draft_top_k={tree.top_k}, draft_step={tree.steps}, verify_tree_size={tree.verify_size}: each "
                   f"must be positive (>= 1)")
    if tree.steps * tree.top_k > max_draft:
        out.append(f"drafting.draftingStep={tree.steps} * drafting.draftingTopK={tree.top_k} = "
                   f"{tree.steps * tree.top_k} exceeds draft.maxDraftTreeSize={max_draft}. Drafting configuration "
                   f"exceeds engine proposal size capability.")
    if tree.steps + 1 > max_draft:
        out.append(f"the accept-token step feeds draft_step + 1 = {tree.steps + 1} tokens through the draft engine, "
                   f"built for max_draft_tree_size={max_draft}")
    if tree.verify_size > max_verify:
        out.append(f"drafting.verifySize={tree.verify_size} exceeds base.maxVerifyTreeSize={max_verify}. "
                   f"Verification size exceeds base engine maximum verification size.")
    if tree.verify_size > candidate_nodes(tree):
        out.append(f"verify_tree_size={tree.verify_size} exceeds the {candidate_nodes(tree)} candidates a tree of "
                   f"draft_top_k={tree.top_k}, draft_step={tree.steps} scores (1 + top_k + (steps - 1) x top_k^2)")
    return out


def builder_limits(cfg: Config) -> dict[str, dict[str, dict[str, Any]]]:
    """engine folder (relative to profile_dir) -> role -> the LLMBuilderConfig fields it is built with: the memory
    plan's limits (max_input_len = max_kv_cache_capacity = graphs.max_context, max_batch_size) and, for the EAGLE-3
    pair, tree capacity for every k in graphs.k_values (a chain of k: k + 1 verified tokens, k + 1 accepted ones
    through the draft), for speculative.eagle3_tree, for Edge-LLM's default tree (DEFAULT_TREE_CAPACITY) and, in
    the draft, for every proposal NVIDIA's sweep tries (SWEEP_DRAFT_CAPACITY), so a tree setting is served
    without a rebuild."""
    g = cfg.graphs
    common = {"max_input_len": g.max_context, "max_kv_cache_capacity": g.max_context}
    if cfg.speculative.drafter != "eagle3":
        return {"engines/plain": {"llm": {**common, "max_batch_size": g.batch_slots}}}
    trees = [EagleTree(1, k, k + 1) for k in g.k_values] + [eagle3_tree(cfg), DEFAULT_TREE]
    verify = max([DEFAULT_TREE_CAPACITY] + [t.verify_size for t in trees])
    draft = max([DEFAULT_TREE_CAPACITY, SWEEP_DRAFT_CAPACITY] + [t.draft_tokens() for t in trees])
    limits = {"engines/eagle3": {"base": {**common, "max_batch_size": 1, "spec_base": True,
                                          "max_verify_tree_size": verify},
                                 "draft": {**common, "max_batch_size": 1, "spec_draft": True,
                                           "max_draft_tree_size": draft}}}
    if g.batch_slots > 1:
        limits["engines/batch"] = {"llm": {**common, "max_batch_size": g.batch_slots}}
    return limits


def visual_limits(cfg: Config) -> dict[str, int] | None:
    """The VisualBuilderConfig fields the visual engine is built with (None: graphs.max_image_tokens 0, text only):
    max_image_tokens = graphs.max_image_tokens (all images of one request together: VisualBuilder::
    setupQwenViTProfile sizes the ViT input to max_image_tokens x 4 patches, spatial_merge_size 2 squared),
    max_image_tokens_per_image = Edge-LLM's default capped at that, min_image_tokens Edge-LLM's default."""
    total = cfg.graphs.max_image_tokens
    if not total:
        return None
    return {"min_image_tokens": min(MIN_IMAGE_TOKENS, total), "max_image_tokens": total,
            "max_image_tokens_per_image": min(MAX_IMAGE_TOKENS_PER_IMAGE, total)}


def images_per_request(limits: dict[str, int]) -> int:
    """The most images one request may carry under a visual engine's builder_config: as many as fit at the per-image
    maximum (an image becomes at most max_image_tokens_per_image tokens, QwenViTRunner::getResizedImageSize; all of
    a request's together at most max_image_tokens, imagePreprocess's maxHW check)."""
    return max(1, int(limits["max_image_tokens"]) // int(limits["max_image_tokens_per_image"]))


def engine_record(cfg: Config) -> dict[str, str | None]:
    """The manifest's "edgellm" record once the engines of builder_limits(cfg) are built: engine_dir (the base +
    draft pair, or the plain engine), draft_engine_dir (the pair's folder, None without a head), batch_engine_dir
    (the RequestEngine's plain engine when graphs.batch_slots > 1, else None)."""
    folders = builder_limits(cfg)
    head = "engines/eagle3" in folders
    target = "engines/eagle3" if head else "engines/plain"
    batch = "engines/batch" if "engines/batch" in folders else (target if cfg.graphs.batch_slots > 1 else None)
    return {"engine_dir": target, "draft_engine_dir": target if head else None, "batch_engine_dir": batch,
            "visual_engine_dir": f"{target}/{VISUAL_FOLDER}" if visual_limits(cfg) else None}


def builder_config_json(fields: dict[str, Any]) -> dict[str, Any]:
    """The builder_config LLMBuilder writes for an engine built with `fields` (LLMBuilderConfig.toJson: the role
    flags spec_base / spec_draft always, each tree size only in the role that owns it)."""
    out = {"spec_base": False, "spec_draft": False, **fields}
    if not out["spec_base"]:
        out.pop("max_verify_tree_size", None)
    if not out["spec_draft"]:
        out.pop("max_draft_tree_size", None)
    return out


def engine_files(cfg: Config) -> dict[str, dict[str, Any] | None]:
    """Every file the engine stage leaves for cfg, relative to profile_dir: an engine -> None, a config -> the
    keys this project relies on (engine_role and spec_decode_type, from the export's config.json, and
    builder_config; the visual engine's config: builder_config)."""
    out: dict[str, dict[str, Any] | None] = {}
    spec = "eagle3" if cfg.speculative.drafter == "eagle3" else "none"
    for folder, roles in builder_limits(cfg).items():
        for role, fields in roles.items():
            out[f"{folder}/{ENGINE_FILE[role]}"] = None
            out[f"{folder}/{CONFIG_FILE[role]}"] = {
                "engine_role": role, "spec_decode_type": spec if role != "llm" else "none",
                BUILDER_CONFIG: builder_config_json(fields)}
    if (limits := visual_limits(cfg)) is not None:
        folder = engine_record(cfg)["visual_engine_dir"]
        out[f"{folder}/{ENGINE_FILE['visual']}"] = None
        out[f"{folder}/{CONFIG_FILE['visual']}"] = {BUILDER_CONFIG: dict(limits)}  # on the export's config
    return out


def read_builder_config(engine_dir: Path, role: str) -> dict[str, Any]:
    """The builder_config of a role's engine in engine_dir (what Edge-LLM's runtime reads back); ManifestError
    naming the file when it is missing or has none."""
    path = Path(engine_dir) / CONFIG_FILE[role]
    try:
        found = json.loads(path.read_text())[BUILDER_CONFIG]
        if not isinstance(found, dict):
            raise TypeError("not a mapping")
        return found
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ManifestError(f"{path} holds no {BUILDER_CONFIG} ({type(err).__name__}: {err}): the engine folder was "
                            f"not written by LLMBuilder; rebuild the engines with "
                            f"`spec-edge build <profile> --force`") from None
