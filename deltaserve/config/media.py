"""What image content the API process accepts (`deltaserve serve` flags, vLLM's names where vLLM has one)."""

from __future__ import annotations

import json
from dataclasses import dataclass

MODALITIES = ("image", "video", "audio")
"""The modality keys of `--limit-mm-per-prompt` (vLLM's); only images are served, the others can only be 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaConfig:
    """Where images may come from and how many and how large they may be; each refusal is a 400 naming the part."""

    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts whose http(s) image URLs are fetched (exact names, redirects checked too); default: any host."""
    allowed_local_media_path: str = ""
    """A directory whose files `file://` image URLs may name (symlinks resolved first); default: file URLs are
    refused."""
    media_fetch_timeout_s: float = 5.0
    """Wall-clock limit on fetching one image URL (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)."""
    max_image_bytes: int = 32 * 2**20
    """Largest fetched image file in bytes (base64 data is bounded by --max-request-bytes)."""
    max_image_pixels: int = 64 * 2**20
    """Largest image, width * height, read from its header before it is decoded."""
    limit_mm_per_prompt: str | None = None
    """Most items per request by modality as JSON, e.g. '{"image": 4}'; default: no limit but the context length."""

    def __post_init__(self) -> None:
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains)
            if any(not d or "/" in d or ":" in d for d in domains):
                raise ValueError(f"allowed_media_domains must be host names (no scheme, port or path), got "
                                 f"{list(self.allowed_media_domains)}")
            object.__setattr__(self, "allowed_media_domains", domains)
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s}")
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.image_limit  # noqa: B018 (validates the JSON now, not on the first request)

    @property
    def image_limit(self) -> int | None:
        """The most images per request, None for no limit."""
        if self.limit_mm_per_prompt is None:
            return None
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}': {exc}") from None
        if not isinstance(limits, dict) or any(key not in MODALITIES for key in limits) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in limits.values()):
            raise ValueError(f"limit_mm_per_prompt must map {', '.join(MODALITIES)} to integers >= 0, got "
                             f"{self.limit_mm_per_prompt!r:.80}")
        limit = limits.get("image")
        return None if limit is None else int(limit)
