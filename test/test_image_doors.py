"""Images through the doors (docs/images.md "Doors"): the HTTP door's image_url parts (a real uvicorn, the official
openai client sending data URLs) and `spec-edge generate --image` against the tiny random-weight vision model
(test/tiny_vlm.py), the tiny text model for "takes no images". The vision model's greedy answer with an image is the
same through each door as through run_one; bad images, a remote URL, images and markers that do not pair are refused
in the front's words and the door answers the next request. The ROS door: test/ros/test_node_images.py."""
from __future__ import annotations

import base64
import io
import json
import logging

import httpx
import numpy as np
import pytest

from tiny_vlm import random_image as make_image
from spec_edge import config as cfgmod
from spec_edge.runtime.requests import IMAGE_MARKER, GenerateRequest, ImageInput, RequestError
from spec_edge.runtime.scheduler import run_one

QUESTION = "What is it?"
MAX_NEW = 12


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


IMAGE = png(make_image(1))


def serve(cfg, engine):
    """A door on 127.0.0.1 serving engine; (door, scheduler)."""
    from spec_edge.http.door import Door
    from spec_edge.runtime.scheduler import Scheduler

    cfg = cfg.replace(**{"http.port": 0})
    logger = logging.getLogger("test_image_doors")
    door = Door(cfg, logger).start()
    scheduler = Scheduler(engine, cfg, logger)
    door.serve(scheduler)
    return door, scheduler


@pytest.fixture(scope="module")
def vlm(tiny_vlm_cfg):
    """(base URL of a door serving the tiny VLM, run_one's answer to QUESTION with IMAGE, taken before the door)."""
    from spec_edge import artifacts

    engine = artifacts.engine(tiny_vlm_cfg, progress=lambda m: None)
    alone = run_one(engine, GenerateRequest(prompt=QUESTION, images=(ImageInput(IMAGE, "png"),),
                                            max_new_tokens=MAX_NEW))
    assert alone.finish_reason in ("length", "eos") and alone.token_ids, alone.message
    door, scheduler = serve(tiny_vlm_cfg, engine)
    yield f"http://127.0.0.1:{door.port}/v1", alone
    scheduler.stop(1.0)
    door.stop()
    engine.close()


@pytest.fixture(scope="module")
def text_door(tiny_cfg):
    """The base URL of a door serving the tiny text-only model."""
    from spec_edge import artifacts

    engine = artifacts.engine(tiny_cfg, progress=lambda m: None)
    door, scheduler = serve(tiny_cfg, engine)
    yield f"http://127.0.0.1:{door.port}/v1"
    scheduler.stop(1.0)
    door.stop()
    engine.close()


def client(base: str):
    import openai

    return openai.OpenAI(base_url=base, api_key="none", max_retries=0)


def ask(c, content, **kwargs):
    return c.chat.completions.create(model=None, messages=[{"role": "user", "content": content}],
                                     max_tokens=MAX_NEW, **kwargs)


def test_schema_binds_parts_in_place():
    """image_url parts become markers where they stand, their images in order across the messages; the
    front's binding then sees the same text as a marker typed by hand."""
    from spec_edge.http.schema import ChatBody

    other = png(make_image(2))
    body = ChatBody(messages=[
        {"role": "system", "content": "You see."},
        {"role": "user", "content": [{"type": "text", "text": "Left:"}, image_part(data_url(IMAGE)),
                                     {"type": "text", "text": " right:"}, image_part(data_url(other, "image/jpeg"))]},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": [image_part(data_url(IMAGE, "image/jpg")), {"type": "text", "text": "And?"}]}])
    request = body.request()
    assert [m.content for m in request.messages] == ["You see.", f"Left:{IMAGE_MARKER} right:{IMAGE_MARKER}", "Two.",
                                                     f"{IMAGE_MARKER}And?"]
    assert request.images == (ImageInput(IMAGE, "png"), ImageInput(other, "jpeg"), ImageInput(IMAGE, "jpeg"))


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "remote URL"),
    ("http://10.0.0.2/cam.jpg", "fetches nothing"),
    ("file:///tmp/cam.png", "not a data URL"),
    ("data:image/webp;base64,AAAA", "send image/jpeg or image/png"),
    ("data:image/png,rawbytes", "not base64"),
    ("data:image/png;base64,***", "not valid base64"),
])
def test_schema_refuses_urls_it_does_not_take(url, words):
    from spec_edge.http.schema import ChatBody

    with pytest.raises(RequestError, match=words) as err:
        ChatBody(messages=[{"role": "user", "content": [image_part(url)]}]).request()
    assert "messages[0].content[0].image_url" in str(err.value)


def test_http_image_answer_equals_run_one(vlm):
    """The openai client with a data URL: the same tokens as run_one with the same PNG (the image part before the
    text, as the front puts an image with no marker)."""
    base, alone = vlm
    answer = ask(client(base), [image_part(data_url(IMAGE)), {"type": "text", "text": QUESTION}])
    assert answer.model_extra["spec_edge"]["token_ids"] == alone.token_ids
    assert answer.choices[0].message.content == alone.text
    import httpx  # the same image again: its encoder output came from the cache, counted in /metrics

    metrics = httpx.get(base.removesuffix("/v1") + "/metrics").text
    assert "spec_edge_image_cache_entries 1" in metrics, metrics
    assert 'spec_edge_image_cache_total{result="hit"} 1' in metrics, metrics


def test_http_bad_images_refused_then_serves(vlm):
    """Each bad image is a 400 with the front's words (images[i]); a normal request right after answers."""
    import openai
    from PIL import Image

    base, alone = vlm
    c = client(base)
    big = io.BytesIO()
    Image.new("L", (4097, 4097)).save(big, format="PNG")  # 16.8 M pixels of zeros: a small file
    cases = [
        ([image_part(data_url(b"not an image at all"))], "images[0] is not a png file"),
        ([image_part(data_url(png(make_image(3)), "image/jpeg"))], "says jpeg but its data is PNG"),
        ([image_part(data_url(big.getvalue()))], "more than the 16777216 an image may hold"),
        ([image_part(data_url(IMAGE)), image_part(data_url(IMAGE)), {"type": "text", "text": IMAGE_MARKER}],
         "2 images but 3 image markers"),
        ([{"type": "text", "text": f"{IMAGE_MARKER} and {IMAGE_MARKER}?"}], "0 images but 2 image markers"),
        ([image_part("https://example.com/cat.png")], "fetches nothing"),
        ([image_part(data_url(IMAGE))] * 5, "5 images in one request; this model takes at most 4"),
    ]
    for content, words in cases:
        with pytest.raises(openai.BadRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ask(c, content)
    assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200
    again = ask(c, [image_part(data_url(IMAGE)), {"type": "text", "text": QUESTION}])
    assert again.model_extra["spec_edge"]["token_ids"] == alone.token_ids


def test_http_images_to_a_text_only_model(text_door):
    import openai

    c = client(text_door)
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        ask(c, [image_part(data_url(IMAGE)), {"type": "text", "text": QUESTION}])
    assert ask(c, QUESTION).choices[0].finish_reason in ("stop", "length")


def test_cli_generate_image_equals_run_one(vlm, tiny_vlm_cfg, tiny_cfg, tmp_path, capsys):
    """`spec-edge generate --image FILE --json`: run_one's tokens; a file that is neither JPEG nor PNG and an
    image to the text-only model exit 2 with what to change."""
    from spec_edge import cli

    _, alone = vlm
    photo, notes = tmp_path / "cam.png", tmp_path / "notes.txt"
    photo.write_bytes(IMAGE)
    notes.write_text("not an image")
    vision, text = tmp_path / "vlm.yaml", tmp_path / "text.yaml"
    vision.write_text(cfgmod.dump(tiny_vlm_cfg))
    text.write_text(cfgmod.dump(tiny_cfg))
    args = ["generate", "--prompt", QUESTION, "--max-new-tokens", str(MAX_NEW), "--json"]
    assert cli.main([*args, "--config", str(vision), "--image", str(photo)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == alone.token_ids
    assert cli.main([*args, "--config", str(vision), "--image", str(notes)]) == 2
    assert "neither a JPEG nor a PNG" in capsys.readouterr().err
    assert cli.main([*args, "--config", str(text), "--image", str(photo)]) == 2
    assert "takes no images" in capsys.readouterr().err
