"""Decode image bytes (PNG, JPEG, WebP, GIF) into RGB pixels with Pillow: the first frame, transparency composited
onto white as transformers' `convert_to_rgb` does, refusals as `ImageError`s."""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, UnidentifiedImageError

from deltaserve.multimodal.errors import ImageError
from deltaserve.multimodal.image_hash import image_content_hash

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The container formats accepted (Pillow's names)."""
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024
"""Default cap on width * height of an accepted image, checked from the header before decoding."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LoadedImage:
    """A decoded image: RGB pixels and their content hash."""

    pixels: np.ndarray = field(repr=False)
    """``[height, width, 3]`` uint8, read-only."""
    content_hash: str
    """`image_content_hash` of the pixels: equal for the same picture in any container or encoding."""

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


def load_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> LoadedImage:
    """Decode `data` (a PNG, JPEG, WebP or GIF file) to RGB.

    Raises:
        ImageError: `not_an_image` (not one of the four formats), `zero_size` (a side of 0 pixels), `too_many_pixels`
            (width * height over `max_pixels`, refused before decoding), `truncated` (the data ends or breaks
            before the pixels do).
    """
    rgb = _decode(data, max_pixels)
    pixels = np.asarray(rgb, dtype=np.uint8)
    pixels.setflags(write=False)
    return LoadedImage(pixels=pixels, content_hash=image_content_hash(pixels))


def load_pil_image(image: Image.Image | np.ndarray, max_pixels: int = DEFAULT_MAX_PIXELS) -> LoadedImage:
    """A Pillow image (its first frame) or a ``[height, width, 3]`` uint8 RGB array, as `load_image` returns it.

    Raises:
        ImageError: `not_an_image` (another array shape or dtype), `zero_size`, `too_many_pixels`.
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageError("not_an_image", f"an image array must be [height, width, 3] uint8 RGB, got "
                             f"{list(image.shape)} {image.dtype}")
        image = Image.fromarray(image, "RGB")
    _check_size(image, max_pixels)
    image.seek(0)
    pixels = np.asarray(_to_rgb(image), dtype=np.uint8)
    pixels.setflags(write=False)
    return LoadedImage(pixels=pixels, content_hash=image_content_hash(pixels))


def _decode(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Pillow's decompression-bomb warning: our own pixel cap below is the check that applies.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError("too_many_pixels", f"image has too many pixels ({e})") from None
    except UnidentifiedImageError:
        if _declares_zero_size(data):
            raise ImageError("zero_size", "image has zero width or height") from None
        raise ImageError("not_an_image", f"data is not a {', '.join(FORMATS[:-1])} or {FORMATS[-1]} image") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        raise ImageError("truncated", f"image data is truncated or corrupt ({e})") from None
    _check_size(image, max_pixels)
    try:
        image.seek(0)  # the first frame of an animation
        image.load()
        return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        raise ImageError("truncated", f"image data is truncated or corrupt ({e})") from None


def _check_size(image: Image.Image, max_pixels: int) -> None:
    width, height = image.size
    if width == 0 or height == 0:
        raise ImageError("zero_size", f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError("too_many_pixels",
                         f"image has {width}x{height} = {width * height} pixels, more than the limit {max_pixels}")


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: an image with alpha (or a transparent palette entry) is composited onto
    white, any other mode converted to RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _declares_zero_size(data: bytes) -> bool:
    """Whether a PNG or GIF header declares a zero side (Pillow refuses to identify such files)."""
    if data.startswith(_PNG_SIGNATURE) and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return width == 0 or height == 0
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return width == 0 or height == 0
    return False
