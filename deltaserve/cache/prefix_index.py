"""State checkpoints of the prefix cache: the KDA state saved at exact token positions, with its own slot budget.

A checkpoint is found by the key of its position L: (hash of the full blocks before L, the tokens of the partial
block up to L). It is immutable: a request that hits it gets a copy in its own running slot. Unpinned checkpoints
are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.cache.state_pool import CHECKPOINT, StatePool

CheckpointKey = tuple[int, tuple[int, ...]]


@dataclass(slots=True)
class Checkpoint:
    key: CheckpointKey
    length: int
    """Tokens covered: the state after the first `length` tokens of the prefix."""
    slot: int
    pins: int = 0
    """Requests that will copy it in the current step; a pinned checkpoint is never evicted."""


class CheckpointIndex:
    """Key -> checkpoint, LRU order for eviction; slots come from the checkpoint share of the state pool."""

    def __init__(self, pool: StatePool, on_evict: Callable[[Checkpoint], None] | None = None) -> None:
        """`on_evict(checkpoint)`: called when a checkpoint is evicted to make room, before its slot is reused."""
        self.pool, self.on_evict = pool, on_evict
        self._entries: OrderedDict[CheckpointKey, Checkpoint] = OrderedDict()  # least recently used first
        self.num_evictions = 0
        self.num_stored_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CheckpointKey) -> Checkpoint | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def contains(self, key: CheckpointKey) -> bool:
        return key in self._entries

    def reserve_slot(self) -> int | None:
        """A checkpoint slot to be written by the runner, evicting the LRU unpinned checkpoint if needed."""
        if self.pool.num_free_of(CHECKPOINT) == 0 and not self._evict_one():
            return None
        return self.pool.allocate(CHECKPOINT)

    def make_room(self) -> bool:
        """Ensure one checkpoint slot is free (for converting a running slot); False if all are pinned."""
        return self.pool.num_free_of(CHECKPOINT) > 0 or self._evict_one()

    def add(self, key: CheckpointKey, length: int, slot: int) -> None:
        """Register a written checkpoint slot; a duplicate key frees the new slot instead."""
        if key in self._entries:
            self.pool.free(slot)
            return
        self._entries[key] = Checkpoint(key=key, length=length, slot=slot)
        self.num_stored_total += 1

    def clear(self) -> int:
        """Drop every unpinned checkpoint; returns how many were dropped."""
        n = 0
        while self._evict_one(demote=False):
            n += 1
        return n

    def _evict_one(self, demote: bool = True) -> bool:
        for key, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[key]
                if demote and self.on_evict is not None:
                    self.on_evict(entry)
                self.pool.free(entry.slot)
                self.num_evictions += 1
                return True
        return False
