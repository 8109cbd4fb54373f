"""The host-memory tier (L2) of the prefix cache: where KV blocks and KDA state checkpoints evicted from the device
go instead of being dropped, and where a later prefix lookup finds them.

Bookkeeping only (the worker holds the host tensors): host block and host state-slot ids, the hash tables that find
them (a full block by its chain hash, a partial block by (parent hash, tokens), a checkpoint by its key), LRU
eviction within the tier, and pins that keep an entry being promoted this step from being overwritten by a
demotion of the same step. Entries are written back on eviction from the device (never written through): a block
that stays on the device costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

BlockKey = tuple[int, tuple[int, ...] | None]
"""(chain hash, None) for a full block; (parent hash, tokens) for a partial block."""
CheckpointKey = tuple[int, tuple[int, ...]]


@dataclass(slots=True)
class HostEntry:
    host_id: int
    length: int = 0
    """Checkpoints: tokens covered."""
    pins: int = 0
    ready: bool = True
    """False while its content is still being fetched from the shared store (lookups skip it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCopies:
    """Copies between the device caches and the host tier (L2), done before the step's other copies: device to host
    first (blocks and checkpoints evicted from the device, whose memory this step may reuse), then host to device
    (prefix hits served from the host tier)."""

    blocks_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block)."""
    states_out: list[tuple[int, int]] = field(default_factory=list)
    """(device state slot, host state slot)."""
    blocks_in: list[tuple[int, int, int]] = field(default_factory=list)
    """(host block, device block, rows)."""
    states_in: list[tuple[int, int]] = field(default_factory=list)
    """(host state slot, device state slot)."""

    def __bool__(self) -> bool:
        return bool(self.blocks_out or self.states_out or self.blocks_in or self.states_in)


class _LRUTier:
    """`capacity` ids with an LRU table of keys; `store` evicts the least recently used unpinned entry."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[Any, HostEntry] = OrderedDict()  # BlockKey or CheckpointKey
        self._free = list(range(capacity - 1, -1, -1))
        self.num_evictions = 0

    def get(self, key: Any) -> HostEntry | None:
        entry = self.entries.get(key)
        if entry is None or not entry.ready:
            return None
        self.entries.move_to_end(key)
        return entry

    def drop(self, key: Any) -> None:
        """Forget `key` (a fetch that failed) and free its id."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._free.append(entry.host_id)

    def store(self, key: Any, length: int = 0) -> int | None:
        """A host id for `key` (None if already held, or if every id is pinned); evicts the LRU entry if full."""
        if key in self.entries or self.capacity == 0:
            return None
        if not self._free:
            victim = next((k for k, e in self.entries.items() if e.pins == 0), None)
            if victim is None:
                return None
            self._free.append(self.entries.pop(victim).host_id)
            self.num_evictions += 1
        host_id = self._free.pop()
        self.entries[key] = HostEntry(host_id, length)
        return host_id

    def clear(self) -> int:
        n = 0
        for key in [k for k, e in self.entries.items() if e.pins == 0]:
            self._free.append(self.entries.pop(key).host_id)
            n += 1
        return n


class HostTier:
    """Host block ids `0..num_blocks-1` and host state-slot ids `0..num_slots-1`, indexed by prefix keys."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.blocks = _LRUTier(num_blocks)
        self.checkpoints = _LRUTier(num_slots)
        self._partials: dict[int, set[tuple[int, ...]]] = {}
        self._pinned: list[HostEntry] = []
        self.demoted_blocks = self.demoted_checkpoints = 0
        self.promoted_blocks = self.promoted_checkpoints = 0

    @property
    def enabled(self) -> bool:
        return self.blocks.capacity > 0

    # -- demotion (device eviction) --------------------------------------------------------------------------------

    def store_block(self, key: BlockKey) -> int | None:
        """The host block to copy an evicted device block into, or None (already here, or no room)."""
        host_id = self.blocks.store(key)
        if host_id is None:
            return None
        self._prune_partials()
        if key[1] is not None:
            self._partials.setdefault(key[0], set()).add(key[1])
        self.demoted_blocks += 1
        return host_id

    def store_checkpoint(self, key: CheckpointKey, length: int) -> int | None:
        """The host slot to copy an evicted device checkpoint into, or None."""
        host_id = self.checkpoints.store(key, length)
        if host_id is not None:
            self.demoted_checkpoints += 1
        return host_id

    # -- lookup ----------------------------------------------------------------------------------------------------

    def full_block(self, chain_hash: int) -> int | None:
        entry = self.blocks.get((chain_hash, None))
        return None if entry is None else entry.host_id

    def partial_blocks(self, parent: int) -> dict[tuple[int, ...], int]:
        """Host partial blocks following `parent`: their tokens -> host id."""
        out = {}
        for tokens in self._partials.get(parent, ()):
            entry = self.blocks.entries.get((parent, tokens))
            if entry is not None and entry.ready:
                out[tokens] = entry.host_id
        return out

    def checkpoint(self, key: CheckpointKey) -> HostEntry | None:
        return self.checkpoints.get(key)

    # -- promotion -------------------------------------------------------------------------------------------------

    def pin_block(self, key: BlockKey) -> None:
        """Keep a block being copied to the device this step (until `end_step`)."""
        self._pin(self.blocks.get(key))
        self.promoted_blocks += 1

    def pin_checkpoint(self, key: CheckpointKey) -> None:
        self._pin(self.checkpoints.get(key))
        self.promoted_checkpoints += 1

    def _pin(self, entry: HostEntry | None) -> None:
        if entry is None:
            raise KeyError("pinning a host entry that is not held")
        entry.pins += 1
        self._pinned.append(entry)

    # -- fetches from the shared store -----------------------------------------------------------------------------

    def reserve(self, kind: str, key: BlockKey | CheckpointKey, length: int = 0) -> int | None:
        """A host id for an entry being fetched from the shared store (`kind` 'kv' or 'state'): held, pinned and
        invisible to lookups until `publish`. None when held already or no room."""
        tier = self.blocks if kind == "kv" else self.checkpoints
        host_id = tier.store(key, length)
        if host_id is not None:
            entry = tier.entries[key]
            entry.ready, entry.pins = False, entry.pins + 1
            if kind == "kv" and key[1] is not None:  # a partial block: findable by its parent once published
                self._prune_partials()
                self._partials.setdefault(key[0], set()).add(key[1])
        return host_id

    def holds(self, kind: str, key: BlockKey | CheckpointKey) -> bool:
        """Whether `key` has an entry, ready or still being fetched."""
        return key in (self.blocks if kind == "kv" else self.checkpoints).entries

    def publish(self, kind: str, key: BlockKey | CheckpointKey, ok: bool) -> None:
        """End a fetch: a good entry becomes findable, a failed one is dropped."""
        tier = self.blocks if kind == "kv" else self.checkpoints
        entry = tier.entries.get(key)
        if entry is None:
            return
        entry.pins -= 1
        if ok:
            entry.ready = True
        else:
            tier.drop(key)

    def end_step(self) -> None:
        for entry in self._pinned:
            entry.pins -= 1
        self._pinned = []

    def clear(self) -> tuple[int, int]:
        """Forget every unpinned entry; returns (blocks, checkpoints) dropped."""
        n = self.blocks.clear(), self.checkpoints.clear()
        self._prune_partials()
        return n

    def _prune_partials(self) -> None:
        """Drop partial-block index entries whose block was evicted (kept lazily: eviction is in `_LRUTier`)."""
        if sum(len(s) for s in self._partials.values()) > 2 * len(self.blocks.entries) + 64:
            self._partials = {}
            for parent, tokens in self.blocks.entries:
                if tokens is not None:
                    self._partials.setdefault(parent, set()).add(tokens)
