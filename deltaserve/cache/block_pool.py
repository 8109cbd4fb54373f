"""The MLA KV block pool: fixed-size pages of latent rows, handed out from a free queue with reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Block ids 0..num_blocks-1. A block is free when its reference count is zero.

    Reference counts let later features (prefix sharing) hold one block from several requests; today each
    allocated block has exactly one holder.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref count 1 each), or None and no change when fewer than n are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free queue."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
