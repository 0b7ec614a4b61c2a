"""Image input on a vision target (docs/images.md): the tiny random-weight Idefics3 / SmolVLM-family model of
test/tiny_vlm.py, made by transformers at test time. The image processor and the encoder graph against
transformers; greedy through the scheduler == transformers' generate token for token; speculative == target-only
with an image, proven to speculate; no prefix reuse across different images; image and text requests batched."""
from __future__ import annotations

import numpy as np
import pytest

from speculated import assert_speculated
from tiny import serve_together
from tiny_vlm import random_image
from spec_edge.runtime.requests import GenerateRequest, ImageInput, RequestError
from spec_edge.runtime.scheduler import run_one

QUESTION = "What is it?"
CHAT = "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"  # the tiny template, HF's marker


def raw(image: np.ndarray) -> ImageInput:
    """An (H, W, 3) uint8 RGB image as a door sends a sensor_msgs/Image (rgb8)."""
    return ImageInput(data=image.tobytes(), encoding="rgb8", width=image.shape[1], height=image.shape[0])


@pytest.fixture(scope="module")
def hf(tiny_vlm):
    """(transformers' Idefics3Processor, Idefics3ForConditionalGeneration) of the tiny folder."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    torch.set_num_threads(1)
    return (AutoProcessor.from_pretrained(str(tiny_vlm)),
            Idefics3ForConditionalGeneration.from_pretrained(str(tiny_vlm), dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_cfg):
    from spec_edge import artifacts

    return artifacts.engine(tiny_vlm_cfg, progress=lambda message: None)


def hf_generate(hf, image: np.ndarray, max_new: int) -> list[int]:
    import torch
    from PIL import Image

    processor, model = hf
    inputs = processor(text=[CHAT], images=[[Image.fromarray(image)]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_processor_equals_transformers(tiny_vlm, hf):
    """pixels() == Idefics3ImageProcessor's pixel_values within 1e-6 (both resizes through Pillow on uint8, then
    float32 arithmetic) for wide, tall, square and extreme images; the expanded prompt ids == the processor's."""
    from PIL import Image

    from spec_edge.runtime.tokenizer import Tokenizer  # noqa: F401 (the decoder's; the folder's file here)
    from spec_edge.graphs.image_processor import VisionSpec, pixels
    from tokenizers import Tokenizer as HFTokenizer

    processor, _ = hf
    spec = VisionSpec.from_folder(tiny_vlm)
    for i, size in enumerate([(48, 80), (100, 30), (64, 64), (7, 200), (301, 299)]):
        image = random_image(i, size)
        ref = processor.image_processor(images=[[Image.fromarray(image)]], return_tensors="np")["pixel_values"][0, 0]
        assert np.abs(pixels(spec, image) - ref).max() < 1e-6, size
    ids = processor(text=[CHAT], images=[[Image.fromarray(random_image(0))]])["input_ids"][0]
    tok = HFTokenizer.from_file(str(tiny_vlm / "tokenizer.json"))
    assert tok.encode(CHAT.replace("<image>", spec.image_text())).ids == list(ids)


def test_encoder_graph_equals_torch(vlm_engine, hf):
    """The exported encoder's rows == Idefics3Model.get_image_features within 1e-4 (rows of size ~3)."""
    import torch

    from spec_edge.graphs.image_processor import pixels

    encoder = vlm_engine.vision
    image = random_image(5)
    x = pixels(encoder.spec, image)
    with torch.no_grad():
        ref = hf[1].model.get_image_features(torch.from_numpy(x)[None, None]).pooler_output[0].numpy()
    assert np.abs(encoder.features(image) - ref).max() < 1e-4


def test_greedy_with_image_equals_transformers(vlm_engine, hf):
    """Two images, each through run_one (the scheduler the doors use): token for token transformers' generate on
    the same folder and processor output; the two answers differ (the image matters), and asking again hits the
    encoder's cache."""
    answers = []
    for seed in (1, 2):
        image = random_image(seed)
        got = run_one(vlm_engine, GenerateRequest(prompt=QUESTION, images=(raw(image),), max_new_tokens=24,
                                                  speculate=False))
        assert got.token_ids == hf_generate(hf, image, 24), seed
        assert got.prompt_tokens == len(hf[0](text=[CHAT], images=[[__import__("PIL.Image").Image.fromarray(image)]])
                                        ["input_ids"][0])
        answers.append(got.token_ids)
    assert answers[0] != answers[1]
    hits = vlm_engine.info()["image_encoder"]["cache_hits"]
    run_one(vlm_engine, GenerateRequest(prompt=QUESTION, images=(raw(random_image(1)),), max_new_tokens=2))
    assert vlm_engine.info()["image_encoder"]["cache_hits"] == hits + 1


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_speculative_with_image_equals_target_only(vlm_engine, drafter):
    """Speculative (n-gram, suffix) == target-only with an image in the prompt, with drafts accepted. The random
    model rarely repeats itself: image 10's answer does (the n-gram drafter's drafts from it are accepted); the
    suffix drafter drafts the second time from the first answer it stored."""
    request = dict(prompt="What?", images=(raw(random_image(10)),), max_new_tokens=76)
    plain = run_one(vlm_engine, GenerateRequest(**request, speculate=False))
    for i in range(2):
        run = run_one(vlm_engine, GenerateRequest(**request, drafter=drafter, k=3))
        assert run.token_ids == plain.token_ids, drafter
        if i == 1 or drafter == "ngram":  # suffix: asked again, its store holds the first answer
            assert_speculated(run.stats, what=f"{drafter}, run {i}")


def test_no_prefix_reuse_across_images(vlm_engine, hf):
    """The same text with another image (the same placeholder ids) reuses no row from the image on: its answer is
    transformers' for its own image, and it reused at most the rows before the first image token."""
    first = run_one(vlm_engine, GenerateRequest(prompt=QUESTION, images=(raw(random_image(1)),), max_new_tokens=16))
    second = run_one(vlm_engine, GenerateRequest(prompt=QUESTION, images=(raw(random_image(2)),), max_new_tokens=16,
                                                 speculate=False))
    assert second.token_ids == hf_generate(hf, random_image(2), 16) != first.token_ids[:16]
    first_image_token = vlm_engine.tokenizer.encode(CHAT.replace("<image>", vlm_engine.vision.spec.image_text())).index(
        vlm_engine.vision.spec.image_token_id)
    assert 0 < second.stats.prompt_tokens_reused <= first_image_token


def test_image_and_text_requests_batched(tiny_vlm_cfg, vlm_engine, hf):
    """Two slots, an image request and a text request at once (scheduler): each as it runs alone."""
    from spec_edge import artifacts

    cfg = tiny_vlm_cfg.replace(**{"graphs.batch_slots": 2})
    engine = artifacts.engine(cfg, progress=lambda message: None)
    image, text = (GenerateRequest(prompt=QUESTION, images=(raw(random_image(1)),), max_new_tokens=20, speculate=False),
                   GenerateRequest(prompt="Move the arm to the left", max_new_tokens=20, speculate=False))
    together = serve_together(engine, [image, text, image])
    assert together[0].token_ids == together[2].token_ids == hf_generate(hf, random_image(1), 20)
    assert together[1].token_ids == run_one(vlm_engine, text).token_ids


def test_image_tokens_in_the_text_refused(vlm_engine):
    """The model's own <image> token typed into the text, with an image or without: refused with what to send (its
    rows would pair with no image), and the engine keeps serving."""
    for images in ((raw(random_image(1)),), ()):
        with pytest.raises(RequestError, match="image tokens"):
            run_one(vlm_engine, GenerateRequest(prompt="<image> what?", images=images, max_new_tokens=4))
    assert run_one(vlm_engine, GenerateRequest(prompt="What?", max_new_tokens=4)).finish_reason == "length"
