"""The KDA state slot pool: one slot (recurrent state + conv window in every KDA layer) per running sequence."""

from __future__ import annotations


class StatePool:
    """Slot ids 0..num_slots-1, handed out lowest first so hot slots stay packed."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot id, or None when all are in use. The caller's runner zeroes it before first use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed but not in use")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)
