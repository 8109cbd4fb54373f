"""Image decoding: the four formats, the first frame, RGB conversion as transformers does it, and each refusal as
an `ImageError` naming what is wrong."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from deltaserve.multimodal import ImageError, image_content_hash, load_image
from tests.vision.images import encode, noise, shapes


@pytest.mark.parametrize("fmt,kwargs", [("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("JPEG", {})])
def test_load_image_formats(fmt, kwargs):
    """PNG, WebP, GIF and JPEG decode to the [H, W, 3] uint8 pixels Pillow gives for that file."""
    source = shapes(37, 53)
    data = encode(source, fmt, **kwargs)
    loaded = load_image(data)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert loaded.pixels.shape == (37, 53, 3) and loaded.pixels.dtype == np.uint8
    np.testing.assert_array_equal(loaded.pixels, expected)
    if fmt in ("PNG", "WEBP"):  # lossless: the source pixels themselves
        np.testing.assert_array_equal(loaded.pixels, np.asarray(source))


def test_gif_first_frame():
    """An animated GIF gives its first frame."""
    frames = [Image.new("RGB", (8, 6), color) for color in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    loaded = load_image(buffer.getvalue())
    assert (loaded.pixels == np.array([255, 0, 0], dtype=np.uint8)).all()


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P-transparent", "I;16"])
def test_rgb_conversion_matches_transformers(mode):
    """Alpha (and a transparent palette entry) is composited onto white, other modes converted, as transformers'
    `convert_to_rgb` does before its processor sees the image."""
    if mode == "P-transparent":
        image = shapes(20, 30).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        data = encode(image, "PNG", transparency=3)
    elif mode == "I;16":
        image = Image.fromarray((np.arange(20 * 30).reshape(20, 30) * 50).astype(np.uint16))
        data = encode(image, "PNG")
    else:
        image = noise(20, 30, seed=3, mode="RGBA").convert(mode)
        data = encode(image, "PNG")
    loaded = load_image(data)
    expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(loaded.pixels, expected)


def _png_with_size(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _bad_inputs() -> dict[str, tuple[bytes, str, str]]:
    png = encode(noise(40, 50), "PNG")
    jpeg = encode(noise(40, 50), "JPEG")
    return {
        "text": (b"hello, this is not an image", "not_an_image", "not a PNG, JPEG, WEBP or GIF image"),
        "empty": (b"", "not_an_image", "not a PNG"),
        "bmp": (encode(noise(4, 4), "BMP"), "not_an_image", "not a PNG"),
        "truncated-png": (png[: len(png) // 2], "truncated", "truncated"),
        "truncated-jpeg": (jpeg[: len(jpeg) // 2], "truncated", "truncated"),
        "zero-width-png": (_png_with_size(0, 5), "zero_size", "zero width or height"),
        "zero-size-png": (_png_with_size(0, 0), "zero_size", "zero width or height"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_images_raise_named_errors(case):
    """Each bad input is an ImageError (a ValueError) whose kind and message say what is wrong."""
    data, kind, words = _bad_inputs()[case]
    with pytest.raises(ImageError, match=words) as info:
        load_image(data)
    assert info.value.kind == kind
    assert isinstance(info.value, ValueError)


def test_too_many_pixels_refused_before_decoding():
    """An image over the pixel cap is refused from its header (the limit and the size are in the message)."""
    data = encode(Image.new("RGB", (300, 200)), "PNG")
    with pytest.raises(ImageError, match=r"300x200 = 60000 pixels, more than the limit 59999") as info:
        load_image(data, max_pixels=59_999)
    assert info.value.kind == "too_many_pixels"
    assert load_image(data, max_pixels=60_000).pixels.shape == (200, 300, 3)


def test_content_hash_is_of_the_pixels():
    """The same pixels hash the same in PNG and lossless WebP; one changed pixel or a transposed shape changes it."""
    image = shapes(24, 40)
    png, webp = load_image(encode(image, "PNG")), load_image(encode(image, "WEBP", lossless=True))
    assert png.content_hash == webp.content_hash == image_content_hash(np.asarray(image))
    changed = np.asarray(image).copy()
    changed[5, 7, 1] ^= 1
    assert image_content_hash(changed) != png.content_hash
    flat = np.zeros((4, 6, 3), dtype=np.uint8)
    assert image_content_hash(flat) != image_content_hash(np.zeros((6, 4, 3), dtype=np.uint8))
    assert len(png.content_hash) == 32
