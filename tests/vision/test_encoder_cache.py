"""`EncoderCache`: least recently used first out, within its byte budget; features over the budget are not kept."""

from __future__ import annotations

import pytest
import torch

from deltaserve.runner.encoder_cache import EncoderCache


def _features(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 4, dtype=torch.float32)  # 16 bytes a row


def test_lru_eviction_within_the_budget():
    cache = EncoderCache(budget_bytes=16 * 10)
    cache.put("a", _features(4))
    cache.put("b", _features(4))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", _features(4))  # 12 rows > 10: b (least recently used) goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes_used == 16 * 8 and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 1)


def test_features_larger_than_the_budget_are_not_kept():
    cache = EncoderCache(budget_bytes=16 * 3)
    cache.put("big", _features(4))
    assert cache.get("big") is None and cache.bytes_used == 0


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        EncoderCache(budget_bytes=-1)
