"""`EncoderCache`: projected image features by image content hash, least recently used first out, bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_ENCODER_CACHE_BYTES = 512 * 1024 * 1024
"""Default budget: about 50 K3 images of 1,024 tokens (7,168 bf16 values per token) at once."""


class EncoderCache:
    """Features of recently seen images, so that later chunks of a prompt and later requests (the next turn of a
    conversation) reuse them instead of running the vision tower again."""

    def __init__(self, budget_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"encoder cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0

    def get(self, content_hash: str) -> torch.Tensor | None:
        """The features of the image with this hash (now the most recently used), or None (counted as a miss)."""
        features = self._entries.get(content_hash)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        return features

    def put(self, content_hash: str, features: torch.Tensor) -> None:
        """Keep `features`, evicting the least recently used entries to stay within the budget; features larger than
        the whole budget are not kept."""
        size = features.numel() * features.element_size()
        if size > self.budget_bytes or content_hash in self._entries:
            return
        while self.bytes_used + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.numel() * old.element_size()
        self._entries[content_hash] = features
        self.bytes_used += size

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0
