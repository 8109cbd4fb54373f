"""The content hash of an image: what the encoder cache and the prefix cache key an image by."""

from __future__ import annotations

import hashlib

import numpy as np

_DOMAIN = b"deltaserve.image.rgb8.v1"


def image_content_hash(pixels: np.ndarray) -> str:
    """A 128-bit BLAKE2b hex digest of decoded RGB pixels and their shape.

    It covers the decoded pixels, not the file bytes, so the same picture hashes the same in PNG or lossless WebP, and
    with different metadata. Caches of anything computed from the image under settings (the preprocessing, the
    encoder) key on this hash together with those settings.

    Args:
        pixels: ``[height, width, 3]`` uint8.
    """
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8 pixels, got {pixels.dtype} {pixels.shape}")
    h = hashlib.blake2b(digest_size=16, person=b"ds-image")
    h.update(_DOMAIN)
    h.update(np.asarray(pixels.shape, dtype="<u8").tobytes())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()
