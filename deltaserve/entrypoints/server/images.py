"""Image content of API requests: base64 data (OpenAI `image_url` data URLs, Anthropic base64 `image` sources) and
http(s) or file URLs (fetched under `--allowed-media-domains` / `--allowed-local-media-path`), decoded and
preprocessed in the API process's render threads, each bad image a 400 naming its content part, and the images
placed on the rendered prompt's placeholder runs (`ImageInput`s for the engine)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltaserve.chat.media import ImageSlot
from deltaserve.config import MediaConfig, ModelConfig
from deltaserve.entrypoints.server.errors import bad_request
from deltaserve.multimodal import ImageError, ImageProcessingConfig, ProcessedImage, load_image, preprocess_image
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.multimodal.media_fetch import FetchPolicy, fetch_image_bytes
from deltaserve.multimodal.prompt_images import placeholder_runs

_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What the served model needs of an image (its tower's preprocessing, its placeholder token) and what the
    server accepts (sources, sizes, how many)."""

    processing: ImageProcessingConfig
    placeholder_id: int
    media: MediaConfig = MediaConfig()

    @classmethod
    def from_model(cls, model_root: str, media: MediaConfig | None = None) -> ImageSupport | None:
        """The support of the checkpoint at `model_root`; None when it has no vision tower (or no path is known)."""
        if not model_root or not (Path(model_root) / "config.json").is_file():
            return None
        vision = ModelConfig.from_pretrained(model_root).vision
        if vision is None:
            return None
        return cls(ImageProcessingConfig.for_vision(vision), vision.media_placeholder_token_id, media or MediaConfig())

    @property
    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(allowed_domains=self.media.allowed_media_domains,
                           local_root=self.media.allowed_local_media_path, timeout_s=self.media.media_fetch_timeout_s,
                           max_bytes=self.media.max_image_bytes)


class RequestImages:
    """One request's images, in the order the conversation holds them."""

    def __init__(self, support: ImageSupport | None) -> None:
        self.support = support
        self.images: list[ProcessedImage] = []

    def add_url(self, url: str, *, param: str) -> ImageSlot:
        """An OpenAI `image_url.url` or an Anthropic url source: a base64 data URL, or an http(s) or file URL
        fetched now (within the server's media options)."""
        match = _DATA_URL.match(url)
        if match is not None:
            return self.add_base64(url[match.end():], param=param)
        if url.lower().startswith("data:"):
            raise bad_request(f"{param}: a data URL must be base64 (data:image/png;base64,...)", param=param)
        support = self._support(param)
        return self._add(lambda: fetch_image_bytes(url, support.fetch_policy), param=param)

    def add_base64(self, data: str, *, param: str) -> ImageSlot:
        """Base64 image bytes (PNG, JPEG, WebP or GIF): decoded and preprocessed now; the slot to place in the text
        of its message (its position is set by the caller). Errors name `param` in the message too (Anthropic's
        error body has no param field)."""
        self._support(param)

        def decode() -> bytes:
            try:
                return base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise bad_request(f"{param}: image data is not valid base64 ({exc})", param=param) from None

        return self._add(decode, param=param)

    def _support(self, param: str) -> ImageSupport:
        if self.support is None:
            raise bad_request(f"{param}: this model has no vision tower: it cannot take images", param=param)
        limit = self.support.media.image_limit
        if limit is not None and len(self.images) >= limit:
            raise bad_request(f"{param}: at most {limit} image{'s' * (limit != 1)} per request are accepted "
                              "(--limit-mm-per-prompt)", param=param, code="too_many_images")
        return self.support

    def _add(self, read: Callable[[], bytes], *, param: str) -> ImageSlot:
        support = self._support(param)
        try:
            loaded = load_image(read(), support.media.max_image_pixels)
            image = preprocess_image(loaded, support.processing)
        except ImageError as exc:
            raise bad_request(f"{param}: bad image ({exc.kind}): {exc}", param=param, code=exc.kind) from None
        self.images.append(image)
        return ImageSlot(position=0, num_tokens=image.num_tokens)

    def place(self, prompt_ids: list[int]) -> tuple[ImageInput, ...]:
        """The images on the prompt's runs of placeholder tokens, in order (the chat formats emit one run per image
        and client text cannot hold the special token); ValueError when they do not match (a format bug)."""
        if not self.images:
            return ()
        assert self.support is not None
        runs = placeholder_runs(prompt_ids, self.support.placeholder_id)
        if [n for _, n in runs] != [image.num_tokens for image in self.images]:
            raise ValueError(f"the prompt's placeholder runs {[n for _, n in runs]} do not match its images' token "
                             f"counts {[image.num_tokens for image in self.images]}")
        return tuple(ImageInput.from_processed(image, start) for image, (start, _) in zip(self.images, runs,
                                                                                            strict=True))
