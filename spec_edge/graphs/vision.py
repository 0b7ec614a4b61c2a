"""A vision target's encoder graph: one image tile in, its image rows out, exported beside the text graphs.

    <engine_dir>/<profile>/onnx/<target form>_vision/   (plan.vision_dir)
      vision_<tile>.onnx   pixel_values (1, 3, tile, tile) -> image_features (N, hidden): the SigLIP encoder, post
                           layer norm, the connector's pixel shuffle and projection (N = vision.json image_tokens)
      vision.json          vision/processor.py VisionSpec: what the image processor does to an image

The encoder is transformers' own modules (models/idefics3/modeling_idefics3.py) loaded from the folder; the one
rule restated is Idefics3VisionEmbeddings.forward's position ids for a full tile (every patch real): its
bucketised fractional coordinates are then patch i's own index, so the tile adds position_embedding rows 0..P-1.
The text model's graphs (export.py) take these rows at prefill through the prefill_image graph.
"""
from __future__ import annotations

from pathlib import Path

from spec_edge.config import Config
from spec_edge.graphs import export, io_names, plan, weights

FORMAT = 1


class VisionTower:
    """pixel_values (1, 3, tile, tile) -> (N, hidden) as Idefics3Model.get_image_features computes a full tile."""

    @staticmethod
    def build(source: str):
        import torch
        from transformers import Idefics3ForConditionalGeneration

        model = Idefics3ForConditionalGeneration.from_pretrained(source, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()

        class Tower(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.vision, self.connector = model.model.vision_model, model.model.connector

            def forward(self, pixel_values):  # (1, 3, tile, tile)
                emb = self.vision.embeddings
                x = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (1, P, vision hidden)
                x = x + emb.position_embedding.weight[None]  # a full tile: patch i at position i (docstring)
                x = self.vision.encoder(inputs_embeds=x, attention_mask=None).last_hidden_state
                x = self.connector(self.vision.post_layernorm(x))  # (1, N, hidden)
                return x[0]

        return Tower().eval()


def ensure_vision(cfg: Config, progress=print) -> Path:
    """The vision target's encoder folder (module docstring), exported once per checkpoint."""
    import torch

    from spec_edge.vision.processor import VisionSpec

    source = cfg.model.target
    spec = VisionSpec.from_folder(weights.resolve(source))
    stem = f"vision_{spec.tile}"
    identity = {"format": FORMAT, "role": "vision", "source": source, "fingerprint": weights.fingerprint(source)}

    def make(todo: dict, folder: Path, store, fresh: bool) -> dict:
        progress(f"[export] vision encoder: {stem} ({spec.image_tokens} image rows per tile) ...")
        tower = VisionTower.build(str(weights.resolve(source)))
        args = (torch.zeros(1, 3, spec.tile, spec.tile),)
        export.save_static(tower, args, [io_names.PIXELS], [io_names.IMAGE_FEATURES], folder / f"{stem}.onnx", store)
        spec.save(folder / "vision.json")
        return {}

    return export.ensure_graphs(plan.vision_dir(cfg), identity, {stem: {"kind": "vision", "width": spec.tile,
                                                                        "rows": 1}}, make, progress, "[vision]")
