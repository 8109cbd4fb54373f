"""Resetting the prefix cache forgets every cached block and checkpoint, without touching held memory."""

from __future__ import annotations

from deltaserve.cache.manager import CacheManager
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams


def _request(rid: str, ids: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=ids, params=SamplingParams(max_tokens=4),
                   stop_token_ids=frozenset(), arrival_index=0, max_total_tokens=1000)


def test_reset_forgets_cached_prefixes_and_frees_their_memory():
    cm = CacheManager(num_blocks=16, num_slots=4, block_size=4, num_checkpoint_slots=4, enable_prefix_caching=True,
                      checkpoint_interval=8)
    ids = list(range(1, 18))
    first = _request("a", ids)
    assert cm.allocate("a", len(ids))
    first.num_computed_tokens = len(ids)
    cm.commit(first)
    cm.free(first)
    cm.end_step()
    assert cm.prefix_stats().cached_blocks > 0 and cm.match(_request("b", [*ids, 99, 98])).length > 0
    blocks, checkpoints = cm.reset_prefix_cache()
    assert blocks > 0 and checkpoints >= 1
    assert cm.prefix_stats().cached_blocks == 0 and cm.prefix_stats().checkpoints_stored == 0
    assert cm.match(_request("c", [*ids, 99, 98])).length == 0
    usage = cm.usage()
    assert usage.num_free_blocks == 16 and usage.num_free_slots == usage.num_slots
