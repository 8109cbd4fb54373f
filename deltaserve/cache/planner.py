"""Turn a memory budget into the two pool sizes: KV blocks (tokens) and KDA state slots (sequences)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheLayout:
    """Sizes the runner allocates and the cache manager hands out."""

    num_blocks: int
    num_slots: int
    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    num_host_blocks: int = 0
    """KV blocks of the host tier (L2; not device memory)."""
    num_host_slots: int = 0
    """State checkpoint slots of the host tier."""

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_slots * self.bytes_per_slot


def plan_cache(
    specs: Sequence[KVCacheSpec | StateCacheSpec],
    *,
    budget_bytes: int,
    block_size: int,
    max_num_seqs: int,
    num_blocks: int | None = None,
    num_slots: int | None = None,
) -> CacheLayout:
    """Split `budget_bytes` between slots and blocks.

    Policy: slots for up to `max_num_seqs` sequences, but never more than half of the budget (a slot is worth
    thousands of tokens of KV); the rest becomes KV blocks. Explicit `num_blocks` / `num_slots` override the plan.
    """
    per_token = sum(s.bytes_per_token for s in specs if isinstance(s, KVCacheSpec))
    per_slot = sum(s.bytes_per_slot for s in specs if isinstance(s, StateCacheSpec))
    per_block = per_token * block_size
    if num_slots is None:
        num_slots = min(max_num_seqs, budget_bytes // 2 // per_slot) if per_slot else max_num_seqs
    if num_blocks is None:
        remaining = budget_bytes - num_slots * per_slot
        num_blocks = remaining // per_block if per_block else 1
    if num_slots < 1 or num_blocks < 1:
        raise ValueError(
            f"cache_memory of {budget_bytes} bytes holds {num_slots} state slot(s) of {per_slot} bytes and "
            f"{num_blocks} KV block(s) of {per_block} bytes (after the prefix-cache checkpoints took their share); "
            "at least one of each is needed: raise cache_memory or lower checkpoint_memory"
        )
    layout = CacheLayout(num_blocks=int(num_blocks), num_slots=int(num_slots), block_size=block_size,
                         bytes_per_block=per_block, bytes_per_slot=per_slot)
    logger.info(
        "cache: %d state slots (%.1f MiB each) = %d concurrent sequences; %d KV blocks of %d tokens = %d tokens "
        "of KV (%.1f MiB in all)", layout.num_slots, per_slot / 2**20, layout.num_slots, layout.num_blocks,
        block_size, layout.num_blocks * block_size, layout.total_bytes / 2**20,
    )
    return layout
