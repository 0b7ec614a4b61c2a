"""A tiny random-weight SmolVLM / Idefics3-family model (SigLIP-style vision encoder, pixel-shuffle connector, Llama
text model) in Hugging Face layout, made by transformers at test time (no download).

The text model's weights are test/tiny.py's (scaled so greedy choices are not near-ties); the tokenizer is
test/tiny.py's with the image special tokens Idefics3Processor expects (<fake_token_around_image>, <image>,
<global-img>, <end_of_utterance>, <row_i_col_j>). One 64x64 tile, 8x8 patches, scale factor 2: 16 image tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_SPECIALS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                  + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)])
TILE, PATCH, SCALE = 64, 8, 2  # image_seq_len = (64 / 8) ** 2 / 2 ** 2 = 16


def make_vlm(path: Path, *, seed: int = 3) -> Path:
    """An Idefics3ForConditionalGeneration folder at path: config.json, model.safetensors, tokenizer files,
    preprocessor_config.json (Idefics3ImageProcessor, one tile of TILE) and processor_config.json."""
    from safetensors.torch import load_file
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    from tiny import make_checkpoint, train_tokenizer

    path = Path(path)
    tok = train_tokenizer()
    tok.add_special_tokens(IMAGE_SPECIALS)
    text_dir = make_checkpoint(path.parent / f"{path.name}_text", seed=seed, tokenizer=tok)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    config = Idefics3Config(
        text_config={k: v for k, v in text_cfg.items() if k not in ("architectures", "_name_or_path")},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": TILE, "patch_size": PATCH, "num_channels": 3},
        scale_factor=SCALE, image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    text = load_file(str(text_dir / "model.safetensors"))
    state = {("lm_head.weight" if k == "lm_head.weight" else "model.text_model." + k[len("model."):]): v
             for k, v in text.items()}
    gen = torch.Generator().manual_seed(seed + 100)
    proj = model.model.connector.modality_projection.proj.weight  # (hidden, vision hidden * SCALE ** 2)
    state["model.connector.modality_projection.proj.weight"] = torch.randn(*proj.shape, generator=gen) \
        / proj.shape[1] ** 0.5  # image rows as large as token embeddings (std 1): the image matters
    patch = model.model.vision_model.embeddings.patch_embedding.weight
    state["model.vision_model.embeddings.patch_embedding.weight"] = torch.randn(*patch.shape, generator=gen) \
        / (patch[0].numel() ** 0.5)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith(("model.vision_model", "model.connector")) for name in missing)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = json.loads((text_dir / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, tokenizer_class="PreTrainedTokenizerFast")))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "do_resize": True, "size": {"longest_edge": TILE},
        "max_image_size": {"longest_edge": TILE}, "do_image_splitting": False, "resample": 1,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_pad": True, "do_convert_rgb": True}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Idefics3Processor",
                                                            "image_seq_len": (TILE // PATCH) ** 2 // SCALE ** 2}))
    return path


def test_image(seed: int, size: tuple[int, int] = (48, 80)):
    """(H, W, 3) uint8 RGB: a random image of size (H, W)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
