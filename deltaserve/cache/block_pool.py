"""The MLA KV block pool: fixed-size pages of latent rows with reference counts and a prefix-hash table.

A block whose reference count drops to zero but that holds a cached prefix stays findable by its hash and is
evicted least recently used first, only when no never-cached free block is left. A partial block (the tail of a
finished sequence) is cached under (parent hash, its tokens); a request reusing it copies its rows into a block of
its own, since it will write past them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_epochs = itertools.count()


class BlockList(list[int]):
    """The block ids of one sequence, in position order, with an `epoch` that changes whenever an entry is removed
    or replaced (appends keep it). A consumer that mirrors the list (the runner's block table rows) can then copy
    only the ids appended since it last looked, when the epoch is the one it saw: per-step work proportional to the
    new blocks, not to the context. The epoch survives pickling and `snapshot()` copies."""

    epoch: int

    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(ids)
        self.epoch = next(_epochs)

    def truncate(self, length: int) -> None:
        """Keep the first `length` ids (a new epoch when any is dropped)."""
        if length < len(self):
            del self[length:]
            self.epoch = next(_epochs)

    def snapshot(self) -> BlockList:
        """A copy with the same epoch (the same ids in the same places)."""
        out = BlockList(self)
        out.epoch = self.epoch
        return out


@dataclass(slots=True)
class _Block:
    ref: int = 0
    full_hash: int | None = None
    partial_key: tuple[int, tuple[int, ...]] | None = None

    @property
    def cached(self) -> bool:
        return self.full_hash is not None or self.partial_key is not None


class BlockPool:
    """Block ids 0..num_blocks-1 and the hash table of cached prefix blocks."""

    def __init__(self, num_blocks: int,
                 on_evict: Callable[[int, tuple[int, tuple[int, ...] | None]], None] | None = None) -> None:
        """`on_evict(block, key)`: called when a cached block is evicted to be reused, before anything writes it;
        `key` is (chain hash, None) for a full block, (parent hash, tokens) for a partial one."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_hash: dict[int, int] = {}
        self._partials: dict[int, dict[tuple[int, ...], int]] = {}  # parent hash -> tokens -> block
        self.num_evictions = 0
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never-cached ones plus evictable cached ones)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash) + sum(len(t) for t in self._partials.values())

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref count 1, or None and no change when fewer than n are free. Evicts LRU cached blocks."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free_plain:
                b = self._free_plain.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)
                rec = self._blocks[b]
                key = (rec.full_hash, None) if rec.full_hash is not None else rec.partial_key
                self._uncache(b)
                self.num_evictions += 1
                if self.on_evict is not None and key is not None:
                    self.on_evict(b, key)
            self._blocks[b].ref = 1
            out.append(b)
        return out

    def touch(self, block: int) -> None:
        """Take one more reference to a (possibly free but cached) block."""
        rec = self._blocks[block]
        if rec.ref == 0:
            self._free_cached.pop(block)
        rec.ref += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at zero a cached block becomes evictable, a plain one free."""
        for b in blocks:
            rec = self._blocks[b]
            if rec.ref <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            rec.ref -= 1
            if rec.ref == 0:
                if rec.cached:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)

    def lookup(self, full_hash: int) -> int | None:
        return self._by_hash.get(full_hash)

    def lookup_partials(self, parent: int) -> dict[tuple[int, ...], int]:
        """Cached partial blocks that follow the chain `parent`: their tokens -> block id."""
        return self._partials.get(parent, {})

    def cache_full(self, block: int, full_hash: int) -> None:
        """Make a held, fully written block findable by its chain hash (no-op if that hash is already cached)."""
        rec = self._blocks[block]
        if full_hash in self._by_hash or rec.cached:
            return
        rec.full_hash = full_hash
        self._by_hash[full_hash] = block

    def cache_partial(self, block: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Make a held block whose first len(tokens) rows are written findable by (parent, tokens)."""
        rec = self._blocks[block]
        table = self._partials.setdefault(parent, {})
        if tokens in table or rec.cached:
            return
        rec.partial_key = (parent, tokens)
        table[tokens] = block

    def _uncache(self, b: int) -> None:
        rec = self._blocks[b]
        if rec.full_hash is not None:
            del self._by_hash[rec.full_hash]
            rec.full_hash = None
        if rec.partial_key is not None:
            parent, tokens = rec.partial_key
            del self._partials[parent][tokens]
            if not self._partials[parent]:
                del self._partials[parent]
            rec.partial_key = None

    def reset_cache(self) -> int:
        """Forget every cached prefix (held blocks stay with their requests, just no longer findable).

        Returns the number of blocks uncached."""
        n = 0
        for b, rec in enumerate(self._blocks):
            if rec.cached:
                self._uncache(b)
                n += 1
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        return n

    def is_free(self, block: int) -> bool:
        """Unreferenced (cached and evictable, or plain)."""
        return self._blocks[block].ref == 0
