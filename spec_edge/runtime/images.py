"""Images as the front takes them: a door's ImageInput (a JPEG / PNG file, or a sensor_msgs/Image's raw rows)
decoded to RGB pixels, with the refusals every door shares. What a vision model does with the pixels (resize,
tiles, normalisation, its encoder) is the model's, not this module's."""
from __future__ import annotations

import io

import numpy as np

from spec_edge.runtime.requests import IMAGE_ENCODINGS, IMAGE_MARKER, ImageInput, RequestError

MAX_IMAGE_BYTES = 32 * 1024 * 1024   # the largest encoded or raw image a request may carry
MAX_IMAGE_PIXELS = 4096 * 4096       # the most pixels one image may hold (width x height)
CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "mono8": 1}
FILE_FORMATS = {"jpeg": "JPEG", "png": "PNG"}  # encoding -> Pillow's format name


def decode(image: ImageInput, name: str) -> np.ndarray:
    """The RGB pixels of image, (H, W, 3) uint8; RequestError (naming it as `name`) for an encoding this does not
    take, undecodable data, or an image past MAX_IMAGE_BYTES / MAX_IMAGE_PIXELS."""
    if image.encoding not in IMAGE_ENCODINGS:
        raise RequestError(f"{name} has encoding '{image.encoding}': send one of {', '.join(IMAGE_ENCODINGS)}")
    if len(image.data) > MAX_IMAGE_BYTES:
        raise RequestError(f"{name} is {len(image.data)} bytes, more than the {MAX_IMAGE_BYTES} an image may be: "
                           "send a smaller or compressed image")
    if image.encoding in FILE_FORMATS:
        return _decode_file(image, name)
    return _decode_raw(image, name)


def _check_size(width: int, height: int, name: str) -> None:
    if width < 1 or height < 1:
        raise RequestError(f"{name} is {width}x{height} pixels: send an image with at least one pixel")
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestError(f"{name} is {width}x{height} = {width * height} pixels, more than the {MAX_IMAGE_PIXELS} "
                           "an image may hold: send a smaller image")


def _decode_file(image: ImageInput, name: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    expected = FILE_FORMATS[image.encoding]
    try:
        with Image.open(io.BytesIO(image.data)) as file:  # reads the header only: the size is checked before pixels
            if file.format != expected:
                raise RequestError(f"{name} says {image.encoding} but its data is "
                                   f"{file.format or 'not an image file'}: send the encoding its bytes are")
            _check_size(file.width, file.height, name)
            return np.asarray(file.convert("RGB"), dtype=np.uint8)  # (H, W, 3)
    except RequestError:
        raise
    except UnidentifiedImageError:
        raise RequestError(f"{name} is not a {image.encoding} file (no image format recognised): send a whole "
                           "JPEG or PNG file") from None
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise RequestError(f"{name} is not a decodable {image.encoding} file ({err}): send a whole JPEG or PNG "
                           "file") from None


def _decode_raw(image: ImageInput, name: str) -> np.ndarray:
    width, height, channels = int(image.width), int(image.height), CHANNELS[image.encoding]
    _check_size(width, height, name)
    step = int(image.step) or width * channels
    if step < width * channels:
        raise RequestError(f"{name}: step {step} is shorter than a row of {width} {image.encoding} pixels "
                           f"({width * channels} bytes): send the image's own step")
    if len(image.data) < step * height:
        raise RequestError(f"{name}: {len(image.data)} bytes of data for {height} rows of {step} bytes "
                           f"({step * height}): send the whole image")
    rows = np.frombuffer(image.data, dtype=np.uint8, count=step * height).reshape(height, step)
    pixels = rows[:, :width * channels].reshape(height, width, channels)  # (H, W, C)
    if image.encoding == "bgr8":
        pixels = pixels[:, :, ::-1]
    elif image.encoding == "rgba8":
        pixels = pixels[:, :, :3]
    elif image.encoding == "mono8":
        pixels = np.repeat(pixels, 3, axis=2)
    return np.ascontiguousarray(pixels)  # (H, W, 3)


def count_markers(texts: list[str]) -> int:
    """How many IMAGE_MARKERs the texts hold."""
    return sum(text.count(IMAGE_MARKER) for text in texts)
