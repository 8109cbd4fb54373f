"""`ImageInput`: one preprocessed image of a request, where its placeholder tokens sit in the prompt. The record the
API process builds and the engine, scheduler, cache manager and runner read; it crosses the process boundary inside
`engine.messages.AddRequest` (msgpack: ints, a str, a tuple and raw bytes, no custom hooks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deltaserve.multimodal.image_processor import ProcessedImage


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInput:
    """An image in a prompt: placeholder tokens [offset, offset + num_tokens) take its projected features."""

    offset: int
    """Index in the prompt of the image's first placeholder token."""
    num_tokens: int
    """Placeholder tokens (= rows of the image's projected features)."""
    content_hash: str
    """`image_content_hash` of the decoded pixels: the key of the encoder cache and of the prefix cache."""
    grid_thw: tuple[int, int, int]
    """(t, h, w) patch grid of `pixel_values`."""
    patch_size: int
    """Pixels per side of a patch."""
    pixel_values: bytes = field(repr=False)
    """``[t * h * w, 3, patch_size, patch_size]`` float32 (little-endian) patches, as raw bytes: msgpack carries
    them as one bin field, and `pixel_array` views them without a copy."""

    @classmethod
    def from_processed(cls, image: ProcessedImage, offset: int) -> ImageInput:
        """The record of `image` with its placeholders starting at prompt index `offset`."""
        values = np.ascontiguousarray(image.pixel_values, dtype="<f4")
        return cls(offset=offset, num_tokens=image.num_tokens, content_hash=image.content_hash,
                   grid_thw=image.grid_thw, patch_size=int(values.shape[-1]), pixel_values=values.tobytes())

    @property
    def end(self) -> int:
        """One past the image's last placeholder token."""
        return self.offset + self.num_tokens

    @property
    def cache_token(self) -> int:
        """What the prefix cache hashes in place of each of this image's placeholder tokens: a negative int64 from
        the content hash (token ids are never negative), so blocks over different images never share a hash and the
        same image at the same place shares them."""
        return -1 - int(self.content_hash[:15], 16)

    def pixel_array(self) -> np.ndarray:
        """`pixel_values` as ``[t * h * w, 3, p, p]`` float32 (a read-only view)."""
        t, h, w = self.grid_thw
        return np.frombuffer(self.pixel_values, dtype="<f4").reshape(t * h * w, 3, self.patch_size, self.patch_size)


def check_images(images: tuple[ImageInput, ...], prompt_token_ids: list[int], placeholder_id: int) -> None:
    """ValueError unless the images lie in order, without overlap, inside the prompt, each over placeholder tokens
    only, and their pixel data has the size their grid says."""
    previous_end = 0
    for i, image in enumerate(images):
        if image.num_tokens < 1 or image.offset < previous_end or image.end > len(prompt_token_ids):
            raise ValueError(f"image {i}: placeholders [{image.offset}, {image.end}) are not inside the prompt "
                             f"(of {len(prompt_token_ids)} tokens) after the previous image")
        if any(t != placeholder_id for t in prompt_token_ids[image.offset:image.end]):
            raise ValueError(f"image {i}: prompt tokens [{image.offset}, {image.end}) are not all the placeholder "
                             f"token {placeholder_id}")
        t, h, w = image.grid_thw
        if min(t, h, w, image.patch_size) < 1 or len(image.pixel_values) != 4 * t * h * w * 3 * image.patch_size ** 2:
            raise ValueError(f"image {i}: {len(image.pixel_values)} bytes of pixel values do not fit grid "
                             f"{image.grid_thw} of {image.patch_size}-pixel patches")
        previous_end = image.end


def keyed_tokens(tokens: list[int], images: tuple[ImageInput, ...], start: int = 0) -> list[int]:
    """`tokens` (positions `start`.. of a prompt) with each image placeholder replaced by its image's
    `cache_token`: what prefix-cache keys and transfer digests hash, so that they tell images apart."""
    out = list(tokens)
    for image in images:
        lo, hi = max(image.offset, start), min(image.end, start + len(out))
        if lo < hi:
            out[lo - start:hi - start] = [image.cache_token] * (hi - lo)
    return out
