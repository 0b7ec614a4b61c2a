"""Images through the ROS door (docs/ros.md "Images"): real rclpy sensor_msgs/Image and CompressedImage messages,
a node serving the tiny random-weight vision model (test/tiny_vlm.py) and one serving the tiny text model. The
vision model's greedy answer with an image is run_one's through the service (`spec-edge ask --image`, a raw rgb8
Image) and the action (`ask --stream`); bad images are refused in the front's words and the node answers the next
request; a text-only node refuses images and keeps serving."""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest

from rosutil import REPO, run_client
from tiny_vlm import random_image as make_image

from spec_edge import config as cfgmod
from spec_edge.runtime.images import decode
from spec_edge.runtime.requests import IMAGE_MARKER, GenerateRequest, ImageInput, RequestError
from spec_edge.runtime.scheduler import run_one

QUESTION = "What is it?"
MAX_NEW = 12
PIXELS = make_image(1)  # (H, W, 3) uint8 RGB


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def raw_job(image: np.ndarray, encoding: str = "rgb8", **fields) -> dict:
    return {"b64": base64.b64encode(image.tobytes()).decode(), "encoding": encoding, "width": image.shape[1],
            "height": image.shape[0], **fields}


def test_messages_map_to_image_inputs():
    """Real messages through to_engine_request: bgr8 with a padded step, rgba8, mono8 and a PNG / an image_transport
    JPEG decode to the pixels sent; the client's image_messages round-trips ImageInputs; a depth or unnamed format
    is refused naming the field."""
    from PIL import Image as Pil
    from sensor_msgs.msg import CompressedImage, Image
    from spec_edge_interfaces.srv import Generate

    from spec_edge.ros2.client import fill_request
    from spec_edge.ros2.messages import compressed_image, to_engine_request

    h, w = PIXELS.shape[:2]
    padded = np.zeros((h, w * 3 + 5), np.uint8)
    padded[:, :w * 3] = PIXELS[:, :, ::-1].reshape(h, w * 3)
    rgba = np.concatenate([PIXELS, np.full((h, w, 1), 7, np.uint8)], axis=2)
    ys, xs = np.mgrid[0:h, 0:w]
    smooth = np.stack([xs * 3, ys * 5, np.full_like(xs, 128)], axis=2).astype(np.uint8)  # JPEG keeps a gradient
    jpeg = io.BytesIO()
    Pil.fromarray(smooth).save(jpeg, format="JPEG", quality=95)
    msg = Generate.Request(prompt=QUESTION, images=[
        Image(encoding="bgr8", width=w, height=h, step=w * 3 + 5, data=padded.tobytes()),
        Image(encoding="rgba8", width=w, height=h, step=w * 4, data=rgba.tobytes()),
        Image(encoding="mono8", width=w, height=h, step=w, data=PIXELS[:, :, 0].tobytes())],
        compressed_images=[CompressedImage(format="png", data=png(PIXELS)),
                           CompressedImage(format="rgb8; jpeg compressed bgr8", data=jpeg.getvalue())])
    request = to_engine_request(msg)
    got = [decode(image, f"images[{i}]") for i, image in enumerate(request.images)]
    assert [i.encoding for i in request.images] == ["bgr8", "rgba8", "mono8", "png", "jpeg"]
    for pixels in (got[0], got[1], got[3]):
        assert np.array_equal(pixels, PIXELS)
    assert np.array_equal(got[2], np.repeat(PIXELS[:, :, :1], 3, axis=2))
    assert np.abs(got[4].astype(int) - smooth).mean() < 3  # lossy, but this image, this way up, in RGB order
    assert np.abs(got[4].astype(int) - smooth[:, :, ::-1]).mean() > 30
    again = to_engine_request(fill_request(Generate.Request(), prompt=QUESTION, images=request.images))
    assert again.images == request.images
    for fmt, words in [("16UC1; compressedDepth png", "a depth image"), ("", "set format to"),
                       ("webp", "set format to")]:
        with pytest.raises(RequestError, match=words) as err:
            compressed_image(CompressedImage(format=fmt, data=png(PIXELS)), "compressed_images[0]")
        assert "compressed_images[0]" in str(err.value)


def test_text_only_node_refuses_images(tiny_cfg, tiny_engine, server_factory, module_env, tmp_path):
    """The tiny text model's node: an image is refused with the front's "takes no images"; the next call answers."""
    server = server_factory(cfgmod.to_params(tiny_cfg), name="text")  # tiny_engine: its graphs exported before
    photo = tmp_path / "cam.png"
    photo.write_bytes(png(PIXELS))
    done = ask(module_env, "--prompt", QUESTION, "--image", str(photo))
    assert done.returncode == 2 and "takes no images" in json.loads(done.stdout)["message"], done.stdout
    [answer] = run_client(module_env, {"mode": "call", "requests": [{"prompt": QUESTION, "max_new_tokens": 4}]})
    assert answer["success"], answer["message"]
    server.stop()  # before the vision node: both are /spec_edge


@pytest.fixture(scope="module")
def vlm_node(tiny_vlm_cfg, server_factory):
    """(the node serving the tiny VLM, run_one's answer to QUESTION with PIXELS, taken before the node starts)."""
    from spec_edge import artifacts

    engine = artifacts.engine(tiny_vlm_cfg, progress=lambda m: None)  # the graphs the node then loads
    alone = run_one(engine, GenerateRequest(prompt=QUESTION, images=(ImageInput(png(PIXELS), "png"),),
                                            max_new_tokens=MAX_NEW))
    engine.close()
    return server_factory(cfgmod.to_params(tiny_vlm_cfg), name="vlm"), alone


def ask(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spec_edge.cli", "ask", "--wait", "120", "--json", *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_image_answer_equals_run_one(vlm_node, module_env, tmp_path):
    """`spec-edge ask --image` (service: a CompressedImage png; --stream: the action) and a raw rgb8 Image through
    the service all give run_one's tokens."""
    _, alone = vlm_node
    photo = tmp_path / "cam.png"
    photo.write_bytes(png(PIXELS))
    for extra in ([], ["--stream"]):
        done = ask(module_env, "--prompt", QUESTION, "--max-new-tokens", str(MAX_NEW), "--image", str(photo), *extra)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        assert answer["token_ids"] == alone.token_ids, extra
    [answer] = run_client(module_env, {"mode": "call", "requests": [
        {"prompt": f"{IMAGE_MARKER}{QUESTION}", "max_new_tokens": MAX_NEW, "images": [raw_job(PIXELS)]}]})
    assert answer["success"] and answer["token_ids"] == alone.token_ids


def test_bad_images_refused_then_serves(vlm_node, module_env):
    """Undecodable, oversized, a wrong encoding, a short step, images and markers that do not pair, a compressed
    format the door does not take: success false with the words saying what to change; the next call answers."""
    _, alone = vlm_node
    small = PIXELS[:4, :4]
    ok = {"prompt": QUESTION, "max_new_tokens": MAX_NEW, "images": [raw_job(PIXELS)]}
    cases = [
        ({"compressed_images": [{"format": "png", "b64": base64.b64encode(b"not a png").decode()}]},
         "images[0] is not a png file"),
        ({"images": [raw_job(small, width=5000, height=4000)]}, "more than the 16777216 an image may hold"),
        ({"images": [raw_job(small, "16UC1")]}, "images[0] has encoding '16UC1'"),
        ({"images": [raw_job(small, step=6)]}, "step 6 is shorter than a row"),
        ({"prompt": f"{IMAGE_MARKER}{QUESTION}", "images": [raw_job(small)] * 2}, "2 images but 1 image markers"),
        ({"prompt": f"{IMAGE_MARKER}{IMAGE_MARKER}{QUESTION}", "images": [raw_job(small)]},
         "1 images but 2 image markers"),
        ({"images": [], "compressed_images": [{"format": "16UC1; compressedDepth png", "b64": ""}]},
         "compressed_images[0] has format '16UC1; compressedDepth png' (a depth image)"),
    ]
    answers = run_client(module_env, {"mode": "call", "requests": [
        {"prompt": QUESTION, "max_new_tokens": MAX_NEW, **fields} for fields, _ in cases] + [ok]})
    for (fields, words), answer in zip(cases, answers):
        assert not answer["success"] and words in answer["message"], (fields.keys(), answer["message"])
    assert answers[-1]["success"] and answers[-1]["token_ids"] == alone.token_ids
