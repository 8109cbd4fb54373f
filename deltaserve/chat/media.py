"""Images in a chat message: where each sits in the message text and how many placeholder tokens it takes, and the
media markers both Kimi formats render for it (Kimi K2.5 / K3: ``<|media_begin|>image<|media_content|>`` then one
``<|media_pad|>`` per image token, then ``<|media_end|>``; transformers' `Kimi_K25Processor` lays videos out the
same way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", \
    "<|media_pad|>"
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
IMAGE_KIND = "image"
"""The text between `<|media_begin|>` and `<|media_content|>` for an image."""


@dataclass(frozen=True, slots=True)
class ImageSlot:
    """An image of a message: rendered before character `position` of the message content."""

    position: int
    """Index into the message content (0: before all text; len(content): after it)."""
    num_tokens: int
    """Its placeholder tokens (the preprocessed image's `num_tokens`)."""


def check_slots(content: str, images: Sequence[ImageSlot]) -> None:
    """ValueError unless the slots lie within the content, in order, each with at least one token."""
    last = 0
    for i, slot in enumerate(images):
        if not isinstance(slot, ImageSlot) or not last <= slot.position <= len(content) or slot.num_tokens < 1:
            raise ValueError(f"message image {i}: {slot!r} is not an ImageSlot in order within the content "
                             f"({len(content)} characters)")
        last = slot.position


def media_ids(special_tokens: Mapping[str, int]) -> dict[str, int]:
    """The four media token ids; ValueError when the tokenizer lacks one (the model takes no images)."""
    missing = [t for t in MEDIA_TOKENS if t not in special_tokens]
    if missing:
        raise ValueError(f"this model's tokenizer has no {', '.join(missing)} token: it cannot take images")
    return {t: special_tokens[t] for t in MEDIA_TOKENS}


def interleave(content: str, images: Sequence[ImageSlot]) -> list[str | ImageSlot]:
    """The content cut at the images: text pieces (non-empty) and the slots, in order."""
    out: list[str | ImageSlot] = []
    start = 0
    for slot in images:
        if slot.position > start:
            out.append(content[start:slot.position])
        out.append(slot)
        start = slot.position
    if start < len(content):
        out.append(content[start:])
    return out
