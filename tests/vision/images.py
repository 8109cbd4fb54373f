"""Deterministic test images, encoded with Pillow."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def noise(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Random pixels (every resize tap matters)."""
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def shapes(height: int, width: int) -> Image.Image:
    """A smooth gradient with a few shapes (natural-image-like edges)."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    image = Image.fromarray(base.astype(np.uint8))
    if height < 8 or width < 8:
        return image
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 5, width * 3 // 5, height * 4 // 5), fill=(250, 30, 40))
    draw.rectangle((width // 2, height // 3, width - 2, height // 2), fill=(20, 200, 90))
    return image


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()
