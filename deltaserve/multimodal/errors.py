"""`ImageError`: why an image was refused, as a ValueError whose message names what is wrong."""

from __future__ import annotations

from typing import Literal

ImageErrorKind = Literal["not_an_image", "truncated", "zero_size", "too_many_pixels", "disallowed_url", "fetch_failed",
                         "too_large"]


class ImageError(ValueError):
    """An image the engine cannot take; `kind` says why (the API layer turns it into a 400 naming the part)."""

    def __init__(self, kind: ImageErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ImageErrorKind = kind
