"""Images given with a raw prompt (the offline `LLM.generate`, vLLM's `multi_modal_data`): each run of placeholder
tokens the prompt holds takes one image, in order, and a run of one placeholder is widened to the image's token
count, so a prompt is written with a single `<|media_pad|>` per image."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from deltaserve.multimodal.errors import ImageError
from deltaserve.multimodal.image_loader import DEFAULT_MAX_PIXELS, load_image, load_pil_image
from deltaserve.multimodal.image_processor import ImageProcessingConfig, preprocess_image
from deltaserve.multimodal.inputs import ImageInput

ImageLike = Image.Image | np.ndarray | bytes
"""A Pillow image, a ``[height, width, 3]`` uint8 RGB array, or the bytes of a PNG, JPEG, WebP or GIF file."""


def place_images(prompt_ids: Sequence[int], images: Sequence[ImageLike], processing: ImageProcessingConfig,
                 placeholder_id: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt with each placeholder run sized to its image, and the images on them.

    Raises:
        ValueError: the prompt's placeholder runs are not one per image, or a run is neither one placeholder nor
            exactly its image's token count; `ImageError` (a ValueError) for an image that cannot be taken.
    """
    runs = placeholder_runs(prompt_ids, placeholder_id)
    if len(runs) != len(images):
        raise ValueError(f"multi_modal_data: {len(images)} image(s) but the prompt has {len(runs)} run(s) of the "
                         f"image placeholder token {placeholder_id} (write one <|media_pad|> per image)")
    out: list[int] = []
    placed: list[ImageInput] = []
    previous_end = 0
    for i, ((start, length), image) in enumerate(zip(runs, images, strict=True)):
        processed = preprocess_image(_load(image, max_pixels, i), processing)
        if length not in (1, processed.num_tokens):
            raise ValueError(f"multi_modal_data image {i}: its placeholder run has {length} tokens; write one "
                             f"placeholder (or exactly {processed.num_tokens}, the image's token count)")
        out.extend(prompt_ids[previous_end:start])
        placed.append(ImageInput.from_processed(processed, len(out)))
        out.extend([placeholder_id] * processed.num_tokens)
        previous_end = start + length
    out.extend(prompt_ids[previous_end:])
    return out, tuple(placed)


def _load(image: ImageLike, max_pixels: int, index: int):  # noqa: ANN202 - a LoadedImage
    try:
        if isinstance(image, bytes | bytearray | memoryview):
            return load_image(bytes(image), max_pixels)
        if isinstance(image, Image.Image | np.ndarray):
            return load_pil_image(image, max_pixels)
    except ImageError as exc:
        raise ImageError(exc.kind, f"multi_modal_data image {index}: {exc}") from None
    raise TypeError(f"multi_modal_data image {index} must be a PIL image, a uint8 RGB array or image file bytes, got "
                    f"{type(image).__name__}")


def placeholder_runs(ids: Sequence[int], placeholder_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `placeholder_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == placeholder_id:
            start = i
            while i < len(ids) and ids[i] == placeholder_id:
                i += 1
            runs.append((start, i - start))
        else:
            i += 1
    return runs
