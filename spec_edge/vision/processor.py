"""A SmolVLM / Idefics3 model's image processor for one tile, in numpy and Pillow, and the prompt expansion of an
image marker into the model's image tokens.

The rules restated here are transformers' (5.x), models/idefics3/image_processing_pil_idefics3.py
Idefics3ImageProcessorPil._preprocess with do_image_splitting false (one tile, no row/column tiles):
  1. resize (do_resize) so the longest edge is size.longest_edge, the other edge int(edge / aspect ratio) rounded
     up to even (_resize_output_size_rescale_to_max_len), then capped at MAX_IMAGE_SIZE 4096 on the longest edge
     (_resize_output_size_scale_below_upper_bound), with the configured resample filter on uint8 (PIL);
  2. resize to the square max_image_size.longest_edge tile (the else branch of do_image_splitting), same filter;
  3. rescale (x rescale_factor) and normalize ((x - mean) / std) in float32; channels first.
and processing_idefics3.py _prompt_single_image: an image is
<fake_token_around_image><global-img><image> x image_seq_len<fake_token_around_image> in the text.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError

MAX_IMAGE_SIZE = 4096  # transformers' idefics3 MAX_IMAGE_SIZE: the longest edge after the first resize
FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<image>", "<global-img>"


@dataclass(frozen=True)
class VisionSpec:
    """What the model's image processor and connector do to one image (read from its Hugging Face folder)."""
    tile: int                        # the encoder's square input (vision_config.image_size)
    longest_edge: int                # the first resize's longest edge (preprocessor size.longest_edge)
    resample: int                    # PIL resample filter (1: LANCZOS, SmolVLM's)
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_tokens: int                # <image> tokens per image (image_seq_len)
    image_token_id: int
    hidden_size: int                 # the text model's width: each image token's row

    @classmethod
    def from_folder(cls, folder: str | Path) -> VisionSpec:
        folder = Path(folder)
        hf = json.loads((folder / "config.json").read_text())
        pre_path = folder / "preprocessor_config.json"
        if not pre_path.is_file():
            raise ConfigError(f"{folder} has no preprocessor_config.json (the model's image processor settings)")
        pre = json.loads(pre_path.read_text())
        vision = hf["vision_config"]
        tile = int(vision["image_size"])
        if int(pre.get("max_image_size", {}).get("longest_edge", tile)) != tile:
            raise ConfigError(f"{pre_path}: max_image_size.longest_edge {pre['max_image_size']} is not the encoder's "
                              f"image_size {tile}")
        tokens = (tile // int(vision["patch_size"])) ** 2 // int(hf.get("scale_factor", 2)) ** 2
        rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else 1.0
        mean, std = (pre.get("image_mean", [0.5] * 3), pre.get("image_std", [0.5] * 3)) \
            if pre.get("do_normalize", True) else ([0.0] * 3, [1.0] * 3)
        return cls(tile=tile, longest_edge=int(pre.get("size", {}).get("longest_edge", tile))
                   if pre.get("do_resize", True) else 0, resample=int(pre.get("resample", 1)),
                   rescale_factor=rescale, mean=tuple(map(float, mean)), std=tuple(map(float, std)),
                   image_tokens=tokens, image_token_id=int(hf["image_token_id"]),
                   hidden_size=int(hf["text_config"]["hidden_size"]))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> VisionSpec:
        raw = json.loads(Path(path).read_text())
        return cls(**{**raw, "mean": tuple(raw["mean"]), "std": tuple(raw["std"])})

    def image_text(self) -> str:
        """The text one image marker becomes (processing_idefics3._prompt_single_image)."""
        return FAKE_TOKEN + GLOBAL_TOKEN + IMAGE_TOKEN * self.image_tokens + FAKE_TOKEN


def first_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) after the first resize (module docstring, step 1)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def pixels(spec: VisionSpec, image: np.ndarray) -> np.ndarray:
    """(3, tile, tile) float32 pixel values of an (H, W, 3) uint8 RGB image (module docstring)."""
    from PIL import Image

    picture = Image.fromarray(np.ascontiguousarray(image, np.uint8), "RGB")
    if spec.longest_edge:
        height, width = first_size(picture.height, picture.width, spec.longest_edge)
        picture = picture.resize((width, height), resample=spec.resample)
    picture = picture.resize((spec.tile, spec.tile), resample=spec.resample)
    x = np.asarray(picture, np.float32) * np.float32(spec.rescale_factor)  # (tile, tile, 3)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), np.float32)
