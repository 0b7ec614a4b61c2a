"""A vision target's image encoder at serving time: the encoder graph (graphs/vision.py) run per image, its output
kept by image content (a bounded LRU: a robot's camera often sends the same frame again, and every request naming
one image costs one encode), and a prompt's image rows for the prefill.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.image_processor import VisionSpec, pixels


class ImageEncoder:
    """The encoder graph of folder (plan.vision_dir) and its output cache of `entries` images."""

    def __init__(self, folder: Path, threads: int, entries: int):
        from spec_edge.runtime.backends.onnxruntime import cpu_session

        self.spec = VisionSpec.load(Path(folder) / "vision.json")
        self.session = cpu_session(str(Path(folder) / f"vision_{self.spec.tile}.onnx"), threads)
        self.entries = entries
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()  # sha256 of (shape, pixels) -> (N, hidden)
        self.hits = self.misses = 0

    def features(self, image: np.ndarray) -> np.ndarray:
        """(N, hidden) float32 image rows of an (H, W, 3) uint8 RGB image (from the cache when it holds them)."""
        image = np.ascontiguousarray(image, np.uint8)
        digest = hashlib.sha256(repr(image.shape).encode())
        digest.update(memoryview(image).cast("B"))  # the pixels in place, no copy
        key = digest.digest()
        rows = self._cache.get(key)
        if rows is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return rows
        self.misses += 1
        rows = self.session.run([io_names.IMAGE_FEATURES], {io_names.PIXELS: pixels(self.spec, image)[None]})[0]
        if self.entries > 0:
            self._cache[key] = rows
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
        return rows

    def rows(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(image rows (P, hidden) float32, image mask (P,) bool) of a prompt's ids (the front made each marker the
        model's image tokens: Capabilities.image_prompt, and checked they pair with the images): each image's N rows
        go to its N image tokens, in order."""
        spec = self.spec
        mask = np.asarray(ids, np.int64) == spec.image_token_id  # (P,)
        rows = np.zeros((len(ids), spec.hidden_size), np.float32)
        rows[mask] = np.concatenate([self.features(image) for image in images])
        return rows, mask

    def info(self) -> dict:
        return {"image_tokens": self.spec.image_tokens, "tile": self.spec.tile, "cache_entries": len(self._cache),
                "cache_limit": self.entries, "cache_hits": self.hits, "cache_misses": self.misses}
