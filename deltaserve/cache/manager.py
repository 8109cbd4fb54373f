"""`CacheManager`: the scheduler's only door to memory. Admission is all or nothing on both pools."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.state_pool import StatePool


@dataclass(slots=True)
class _Holding:
    slot: int
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheUsage:
    """A snapshot for metrics and logs."""

    num_blocks: int
    num_free_blocks: int
    num_slots: int
    num_free_slots: int


class CacheManager:
    """Tracks which KV blocks and which state slot each request holds."""

    def __init__(self, *, num_blocks: int, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots)
        self._held: dict[str, _Holding] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens cached tokens fits an otherwise empty cache."""
        return self.blocks_for(num_tokens) <= self.blocks.num_blocks

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request hold blocks for `num_tokens` cached tokens and a state slot.

        All or nothing: on False nothing changed. Returns True at once when it already holds enough.
        """
        held = self._held.get(request_id)
        need_blocks = self.blocks_for(num_tokens) - (len(held.blocks) if held else 0)
        if need_blocks > self.blocks.num_free or (held is None and self.slots.num_free == 0):
            return False
        if held is None:
            slot = self.slots.allocate()
            assert slot is not None  # checked above
            held = self._held[request_id] = _Holding(slot)
        if need_blocks > 0:
            new = self.blocks.allocate(need_blocks)
            assert new is not None  # checked above
            held.blocks.extend(new)
        return True

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def slot(self, request_id: str) -> int:
        return self._held[request_id].slot

    def block_ids(self, request_id: str) -> list[int]:
        return self._held[request_id].blocks

    def free(self, request_id: str) -> None:
        """Return every block and the slot of the request (no-op if it holds nothing)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self.blocks.free(held.blocks)
        self.slots.free(held.slot)

    def usage(self) -> CacheUsage:
        return CacheUsage(num_blocks=self.blocks.num_blocks, num_free_blocks=self.blocks.num_free,
                          num_slots=self.slots.num_slots, num_free_slots=self.slots.num_free)
