"""The KDA state slot pool: running slots (one per running sequence), checkpoint slots (prefix cache) and scratch
slots (the state after each proposed token of a speculative step).

All kinds share one range of slot ids (one set of device tensors), each kind under its own cap, so a finished
sequence's running slot can become a checkpoint, and a verified scratch state the running one, without a copy.
"""

from __future__ import annotations

import heapq

RUNNING = "running"
CHECKPOINT = "checkpoint"
SCRATCH = "scratch"


class StatePool:
    """Slot ids 0..num_running + num_checkpoints - 1: running slots handed out lowest first, checkpoint slots
    highest first, so that running sequences tend to hold consecutive slots (the KDA decode then updates their
    states in place instead of gathering and scattering them; see `ForwardBatch.decode_slot_range`)."""

    def __init__(self, num_slots: int, num_checkpoint_slots: int = 0, num_scratch_slots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        self.num_scratch_slots = num_scratch_slots
        total = num_slots + num_checkpoint_slots + num_scratch_slots
        self._free = set(range(total))
        # Two heaps over the free ids (lowest first, highest first); ids allocated through the other heap are left
        # in place and skipped when popped, and the heaps are rebuilt when such stale entries pile up.
        self._low = list(range(total))
        self._high = [-i for i in reversed(range(total))]
        self._kind: dict[int, str] = {}
        self._count = {RUNNING: 0, CHECKPOINT: 0, SCRATCH: 0}
        self._cap = {RUNNING: num_slots, CHECKPOINT: num_checkpoint_slots, SCRATCH: num_scratch_slots}

    @property
    def num_free(self) -> int:
        """Running slots that can be allocated now."""
        return self._cap[RUNNING] - self._count[RUNNING]

    def num_free_of(self, kind: str) -> int:
        return self._cap[kind] - self._count[kind]

    def allocate(self, kind: str = RUNNING) -> int | None:
        """A free slot id of `kind`, or None at that kind's cap. The runner zeroes or overwrites it before use."""
        if self._count[kind] >= self._cap[kind]:
            return None
        return self.take(kind)

    def take(self, kind: str) -> int:
        """A free slot id of `kind`, which the caller checked is below its cap (`num_free_of`)."""
        if self._count[kind] >= self._cap[kind]:
            raise RuntimeError(f"no free {kind} state slot")
        slot = self._pop(self._low, 1) if kind == RUNNING else self._pop(self._high, -1)
        self._free.discard(slot)
        self._kind[slot] = kind
        self._count[kind] += 1
        return slot

    def convert(self, slot: int, kind: str) -> bool:
        """Re-label a used slot as `kind` (e.g. running -> checkpoint); False at that kind's cap."""
        old = self._kind[slot]
        if old == kind:
            return True
        if self._count[kind] >= self._cap[kind]:
            return False
        self._count[old] -= 1
        self._count[kind] += 1
        self._kind[slot] = kind
        return True

    def swap_kinds(self, a: int, b: int) -> None:
        """Exchange the kinds of two used slots (a verified scratch state becomes a request's running slot, its old
        running slot scratch): the counts are unchanged."""
        self._kind[a], self._kind[b] = self._kind[b], self._kind[a]

    def free(self, slot: int) -> None:
        kind = self._kind.pop(slot, None)
        if kind is None:
            raise RuntimeError(f"state slot {slot} freed but not in use")
        self._count[kind] -= 1
        self._free.add(slot)
        heapq.heappush(self._low, slot)
        heapq.heappush(self._high, -slot)
        if len(self._low) + len(self._high) > 4 * len(self._free) + 64:  # mostly stale: rebuild both
            self._low = sorted(self._free)
            self._high = sorted(-i for i in self._free)

    def _pop(self, heap: list[int], sign: int) -> int:
        while True:
            slot = sign * heapq.heappop(heap)
            if slot in self._free:
                return slot
