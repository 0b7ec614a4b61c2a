"""Edge-LLM's visual engine as the runtime adapter (backends/edgellm.py) meets it: the folder `spec-edge build` made and
what its config.json says (docs/tensorrt.md, "Images: Edge-LLM's VLM pipeline"), and an image as the PNG bytes
Edge-LLM's load_image_from_bytes reads."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec_edge import edgellm_layout
from spec_edge.config import Config, ConfigError
from spec_edge.runtime.backends.base import BackendError


@dataclass(frozen=True)
class VisualEngine:
    """The visual engine `spec-edge build` made (edgellm_layout.visual_limits), as its config.json says: the folder
    (multimodal_engine_dir), the most images one request may carry, the most tokens one image becomes, and the
    token ids of the Qwen-VL image span the prompt text holds for each image."""
    engine_dir: Path
    images: int                 # edgellm_layout.images_per_request of its builder_config
    tokens_per_image: int       # builder_config max_image_tokens_per_image
    span_ids: tuple[int, int, int]  # (vision_start_token_id, image_token_id, vision_end_token_id)


def visual_engine(cfg: Config, build: str) -> VisualEngine | None:
    """The profile's visual engine (None when graphs.max_image_tokens is 0); BackendError naming the build command
    when it is missing, not built for a Qwen-VL model, or its config.json lacks what the runtime reads
    (QwenViTRunner::validateAndFillConfig: model_type, vision_start_token_id, image_token_id, builder_config; its
    max_image_tokens / max_image_tokens_per_image as the wheel's server reads them, engine.py _video_frame_limits)."""
    if not cfg.graphs.max_image_tokens:
        return None
    try:
        folder = edgellm_layout.visual_engine_dir(cfg)
    except (edgellm_layout.ManifestError, ConfigError) as err:
        raise BackendError(str(err)) from None
    if folder is None:
        raise BackendError(f"graphs.max_image_tokens={cfg.graphs.max_image_tokens} needs the visual engine and the "
                           f"build of profile '{cfg.runtime.profile}' has none: {build}")
    path = folder / edgellm_layout.CONFIG_FILE["visual"]
    try:
        found = json.loads(path.read_text())
        limits = found[edgellm_layout.BUILDER_CONFIG]
        model_type = (found.get("vision_config") or {}).get("model_type") or found["model_type"]
        span = (int(found["vision_start_token_id"]), int(found["image_token_id"]),
                int(found["vision_end_token_id"]))
        engine = VisualEngine(folder, edgellm_layout.images_per_request(limits),
                              int(limits["max_image_tokens_per_image"]), span)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BackendError(f"{path} is not the config.json of a Qwen-VL visual engine ({type(err).__name__}: {err}): "
                           f"{build}") from None
    if model_type not in edgellm_layout.VISION_MODEL_TYPES:
        raise BackendError(f"{path} is a '{model_type}' visual engine; spec_edge sends images to the Qwen-VL family "
                           f"({', '.join(edgellm_layout.VISION_MODEL_TYPES)}) only: serve one of those, or set "
                           f"graphs.max_image_tokens: 0")
    return engine


def multimodal_dir(visual: VisualEngine | None) -> str:
    """LLMRuntime / RequestEngine's multimodal_engine_dir: the bundle root holding the visual engine's folder, as the
    wheel's server passes it (experimental/server/runtime/engine_layout.py BundleLayout.media_dir: the root when
    <root>/visual/visual.engine exists), '' (their default) for a text-only profile."""
    return str(visual.engine_dir.parent) if visual is not None else ""


def png(pixels) -> bytes:
    """An (H, W, 3) uint8 RGB image as PNG file bytes (lossless: the runtime decodes the same pixels)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=1)
    return out.getvalue()
