"""`CacheManager`: the scheduler's only door to memory.

It owns the KV block pool (with its prefix-hash table), the state slot pool (running and checkpoint slots) and the
checkpoint index. Admission is all or nothing on both pools. With prefix caching on, a prompt's hit of length L
needs cached KV blocks covering [0, L) and a state checkpoint at exactly L; the request then holds the cached full
blocks, gets a copy of a cached partial block and a copy of the checkpoint in its own slot. The copies are handed
to the runner as step operations (`take_copies`).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from deltaserve.cache.block_hash import chain_hashes, parent_hash
from deltaserve.cache.block_pool import BlockList, BlockPool
from deltaserve.cache.host_tier import BlockKey, HostCopies, HostTier
from deltaserve.cache.prefix_index import Checkpoint, CheckpointIndex, CheckpointKey
from deltaserve.cache.remote import RemoteFetch
from deltaserve.cache.state_pool import CHECKPOINT, RUNNING, SCRATCH, StatePool
from deltaserve.request import Request


@dataclass(slots=True)
class _Holding:
    slot: int
    blocks: BlockList = field(default_factory=BlockList)
    num_registered: int = 0
    """Leading blocks already in the hash table (cached hits count as registered)."""
    pending: list[tuple[int, int]] = field(default_factory=list)
    """(position, checkpoint slot) reserved for checkpoints the runner writes; registered once computed."""
    scratch: list[int] = field(default_factory=list)
    """Scratch slots of this step's proposed tokens: scratch[i] gets the state after i + 1 of the step's tokens."""


_Where = TypeVar("_Where", str, int)
"""Where a fetch reads an entry: a shared-store key, or a block index of a remote transfer."""


class SharedLookup(Protocol):
    """What the cache manager needs of the shared store (L3): whether an entry exists (`kvstore.KVStore`)."""

    def contains(self, key: str) -> bool: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedStoreOps:
    """The step's traffic with the shared store (L3), done by every worker rank on its own part of each entry:
    `puts` read a device block or state slot before anything else this step (write-through of what the previous
    step registered), `fetches` write a host-tier block or slot, which the scheduler publishes after the step if
    every rank got its part. Keys are content hashes (the same in every process): `kv/<chain digest>` for a block,
    `state/<chain digest>` for the state after a block boundary."""

    puts: list[tuple[str, str, int]] = field(default_factory=list)
    """(kind 'kv' or 'state', key, device block or slot)."""
    fetches: list[tuple[str, str, int]] = field(default_factory=list)
    """(kind, key, host block or slot)."""

    def __bool__(self) -> bool:
        return bool(self.puts or self.fetches)


SHARED_PUT_MEMORY = 65536
"""Keys this manager remembers having written to the shared store (not written again)."""


@dataclass(frozen=True, slots=True)
class HostRef:
    """An entry of the host tier: its id there and its key (for pinning while it is copied back)."""

    host_id: int
    key: BlockKey | CheckpointKey


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """The longest reusable prefix of a request: blocks and a checkpoint, both for exactly `length` tokens, each on
    the device or in the host tier."""

    length: int = 0
    blocks: tuple[int | HostRef, ...] = ()
    """Cached full blocks covering [0, length // block_size * block_size): device block ids, or host-tier entries
    (copied into new device blocks)."""
    partial_block: int | HostRef | None = None
    """Cached block whose first length % block_size rows continue the prefix (copied, never written)."""
    checkpoint: Checkpoint | HostRef | None = None

    @property
    def uses_host(self) -> bool:
        """Whether any part comes from the host tier."""
        return any(isinstance(x, HostRef) for x in (*self.blocks, self.partial_block, self.checkpoint))


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheUsage:
    """A snapshot for metrics and logs."""

    num_blocks: int
    num_free_blocks: int
    num_slots: int
    num_free_slots: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheStats:
    """Prefix-cache counters (cumulative unless noted)."""

    queried_tokens: int
    hit_tokens: int
    checkpoints_stored: int
    """Checkpoints currently held (not cumulative)."""
    checkpoints_created: int
    checkpoint_bytes: int
    """Bytes of the checkpoints currently held."""
    cached_blocks: int
    """KV blocks currently findable by hash (not cumulative)."""
    block_evictions: int
    checkpoint_evictions: int
    host_hit_tokens: int = 0
    """Tokens of the hits that needed the host tier (counted in hit_tokens too)."""
    host_blocks: int = 0
    """Blocks the host tier holds (not cumulative)."""
    host_checkpoints: int = 0
    """Checkpoints the host tier holds (not cumulative)."""
    host_blocks_demoted: int = 0
    host_checkpoints_demoted: int = 0
    host_blocks_promoted: int = 0
    host_checkpoints_promoted: int = 0


def _digest(tokens: list[int], previous: str | None) -> str:
    """blake2b of `tokens`, keyed by the `previous` digest of the chain (none for the first block)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16,
                           key=bytes.fromhex(previous) if previous else b"").hexdigest()


class CacheManager:
    """Tracks which KV blocks and which state slot each request holds, and the prefix cache."""

    def __init__(self, *, num_blocks: int, num_slots: int, block_size: int, num_checkpoint_slots: int = 0,
                 bytes_per_slot: int = 0, enable_prefix_caching: bool = False,
                 checkpoint_interval: int | None = None, num_scratch_slots: int = 0, num_host_blocks: int = 0,
                 num_host_slots: int = 0, block_bytes: int = 0, shared: SharedLookup | None = None) -> None:
        """`num_host_blocks`, `num_host_slots`: the host tier (L2) that evicted blocks and checkpoints go to (0: no
        host tier; prefix caching only). `block_bytes`, `bytes_per_slot`: sizes, for byte counts in metrics.
        `shared`: the shared store (L3; needs the host tier, where its entries are fetched to)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.checkpoint_interval = checkpoint_interval
        self.bytes_per_slot, self.block_bytes = bytes_per_slot, block_bytes
        on = enable_prefix_caching and num_host_blocks > 0
        self.host = HostTier(num_host_blocks if on else 0, num_host_slots if on else 0)
        self.blocks = BlockPool(num_blocks, on_evict=self._demote_block if on else None)
        self.slots = StatePool(num_slots, num_checkpoint_slots if enable_prefix_caching else 0, num_scratch_slots)
        self.checkpoints = CheckpointIndex(self.slots, on_evict=self._demote_checkpoint if on else None)
        self._host_copies = HostCopies()
        self._host_hit = 0
        self.shared = shared if on else None
        self._stable: dict[str, list[str]] = {}
        """Per request: content digests of its block chain (the same in every process, unlike `_hashes`)."""
        self._shared_ops = SharedStoreOps()
        self._fetching: dict[str, list[tuple[str, BlockKey | CheckpointKey]]] = {}
        """Requests waiting for shared-store fetches: the host entries reserved for them."""
        self._step_fetches: list[tuple[str, BlockKey | CheckpointKey]] = []
        """This step's fetches, in the order of `SharedStoreOps.fetches`."""
        self._probed: set[str] = set()
        self._probed_remote: set[str] = set()
        self._put_keys: OrderedDict[str, None] = OrderedDict()
        self.shared_fetched = self.shared_fetch_failures = 0
        """Entries fetched from the shared store and published, and fetches that failed (on some rank)."""
        self._remote_ops: list[RemoteFetch] = []
        self._remote_step: list[tuple[str, list[tuple[str, BlockKey | CheckpointKey]]]] = []
        """Per remote fetch of this step: the host entries reserved for it."""
        self.remote_fetched = self.remote_failures = self.remote_skipped = 0
        """Disaggregation, decode side: transfers fetched and published, transfers that failed (recomputed), and
        transfers not fetched (the local cache held the prefix, or the host tier had no room: recomputed)."""
        self._held: dict[str, _Holding] = {}
        self._hashes: dict[str, list[int]] = {}
        self._block_copies: list[tuple[int, int, int]] = []
        self._state_copies: list[tuple[int, int]] = []
        self._step_blocks: list[int] = []
        self._step_checkpoints: list[Checkpoint] = []
        self._queried = self._hit = 0

    # -- sizes ---------------------------------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens cached tokens fits an otherwise empty cache."""
        return self.blocks_for(num_tokens) <= self.blocks.num_blocks

    # -- prefix lookup -------------------------------------------------------------------------------------------

    def hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chain hashes of the request's first `num_blocks` full blocks (extended lazily)."""
        return self._chain(request, num_blocks)[:num_blocks]

    def _chain(self, request: Request, num_blocks: int) -> list[int]:
        """The request's own list of chain hashes, extended to at least `num_blocks` (not a copy: callers index it).

        Only the blocks not hashed yet are sliced and hashed, so a step costs what it adds, not the context."""
        bs, hashes = self.block_size, self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            tokens = request.cache_token_slice(len(hashes) * bs, num_blocks * bs)
            hashes.extend(chain_hashes(tokens, bs, parent=parent_hash(hashes, len(hashes))))
        return hashes

    def match(self, request: Request) -> PrefixHit:
        """The longest prefix with cached KV and a checkpoint at its end; at least one token is left to compute.
        None for a request with `skip_prefix_cache`."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return PrefixHit()
        bs, limit, host = self.block_size, request.num_tokens - 1, self.host
        hashes = self.hashes(request, limit // bs)
        blocks: list[int | HostRef] = []
        for h in hashes:
            b: int | HostRef | None = self.blocks.lookup(h)
            if b is None and host.enabled:
                hb = host.full_block(h)
                b = None if hb is None else HostRef(hb, (h, None))
            if b is None:
                break
            blocks.append(b)
        for j in range(len(blocks), -1, -1):
            parent = parent_hash(hashes, j)
            partials: dict[tuple[int, ...], int | HostRef] = {}
            if host.enabled:
                partials.update({t: HostRef(hb, (parent, t)) for t, hb in host.partial_blocks(parent).items()})
            partials.update(self.blocks.lookup_partials(parent))  # the device copy when both hold one
            best: tuple[int, int | HostRef, Checkpoint | HostRef] | None = None
            for tokens, block in partials.items():
                length = j * bs + len(tokens)
                if length > limit or (best and len(tokens) <= best[0] - j * bs):
                    continue
                ckpt = self._checkpoint((parent, tokens))
                if ckpt is not None and tuple(request.cache_token_slice(j * bs, length)) == tokens:
                    best = (length, block, ckpt)
            if best is not None:
                return PrefixHit(length=best[0], blocks=tuple(blocks[:j]), partial_block=best[1], checkpoint=best[2])
            ckpt = self._checkpoint((parent, ())) if j else None
            if ckpt is not None:
                return PrefixHit(length=j * bs, blocks=tuple(blocks[:j]), checkpoint=ckpt)
        return PrefixHit()

    def _checkpoint(self, key: CheckpointKey) -> Checkpoint | HostRef | None:
        """The checkpoint at `key`: on the device, else in the host tier."""
        ckpt = self.checkpoints.get(key)
        if ckpt is not None or not self.host.enabled:
            return ckpt
        entry = self.host.checkpoint(key)
        return None if entry is None else HostRef(entry.host_id, key)

    # -- the host tier ---------------------------------------------------------------------------------------------

    def _demote_block(self, block: int, key: BlockKey) -> None:
        """A cached device block is being evicted: copy it to the host tier first (unless it is there already)."""
        host_id = self.host.store_block(key)
        if host_id is not None:
            self._host_copies.blocks_out.append((block, host_id))

    def _demote_checkpoint(self, ckpt: Checkpoint) -> None:
        host_id = self.host.store_checkpoint(ckpt.key, ckpt.length)
        if host_id is not None:
            self._host_copies.states_out.append((ckpt.slot, host_id))

    def take_host_copies(self) -> HostCopies | None:
        """This step's copies to and from the host tier (None when there are none); see `HostCopies`."""
        out, self._host_copies = self._host_copies, HostCopies()
        return out if out else None

    # -- the shared store (L3) -------------------------------------------------------------------------------------

    def _stable_chain(self, request: Request, num_blocks: int) -> list[str]:
        """Content digests of the request's first `num_blocks` blocks, each covering every token before it (blake2b
        keyed by the previous digest): the shared store's keys, equal in every process and engine."""
        bs, chain = self.block_size, self._stable.setdefault(request.request_id, [])
        while len(chain) < num_blocks:
            j = len(chain)
            chain.append(_digest(request.cache_token_slice(j * bs, (j + 1) * bs), chain[-1] if chain else None))
        return chain

    def _stable_digest(self, request: Request, length: int) -> str:
        """The digest of the request's first `length` tokens: the chain's at a block boundary, else that of the
        tokens past the last full block, keyed by the chain (fewer tokens than a block: never a full block's)."""
        full = length // self.block_size
        chain = self._stable_chain(request, full)
        if length == full * self.block_size:
            return chain[full - 1]
        return _digest(request.cache_token_slice(full * self.block_size, length), chain[full - 1] if full else None)

    def _put(self, kind: str, key: str, where: int) -> None:
        """Write-through of a registered block or checkpoint (once per key this manager knows of)."""
        if key in self._put_keys:
            self._put_keys.move_to_end(key)
            return
        self._put_keys[key] = None
        if len(self._put_keys) > SHARED_PUT_MEMORY:
            self._put_keys.popitem(last=False)
        self._shared_ops.puts.append((kind, key, where))

    def prefetch(self, request: Request) -> bool:
        """Before admitting `request`: if the shared store holds more of its prefix than the device and host tiers
        (blocks past theirs up to a block boundary that has a state, or up to where an earlier request with this
        prefix ended), reserve host-tier entries and queue their fetches for this step; True while the request must
        wait for them (it is admitted after the step, and its hit then comes from the host tier). Probed once per
        request; a store that fails is a miss."""
        rid = request.request_id
        if rid in self._fetching:
            return True
        if self.shared is None or rid in self._probed or request.skip_prefix_cache:
            return False
        self._probed.add(rid)
        held = self._reserve(self._store_entries(request))
        if held is None:  # no room in the host tier (everything pinned): give the fetch up
            return False
        reserved, ops = held
        if not ops:
            return False
        self._fetching[rid] = reserved
        self._step_fetches += reserved
        self._shared_ops.fetches.extend(ops)
        return True

    def _reserve(self, wanted: Sequence[tuple[str, BlockKey | CheckpointKey, _Where, int]]
                 ) -> tuple[list[tuple[str, BlockKey | CheckpointKey]], list[tuple[str, _Where, int]]] | None:
        """Host-tier entries for fetches of `wanted` (kind, key, where the fetch reads it, length): (the reserved
        (kind, key)s, (kind, where, host id) of each fetch to make; keys the tier holds already, or is fetching for
        another request, need none); None, with nothing reserved, when one finds no room."""
        reserved: list[tuple[str, BlockKey | CheckpointKey]] = []
        fetches: list[tuple[str, _Where, int]] = []
        for kind, key, where, length in wanted:
            if self.host.holds(kind, key):
                continue
            host_id = self.host.reserve(kind, key, length)
            if host_id is None:
                for k, held_key in reserved:
                    self.host.publish(k, held_key, ok=False)
                return None
            reserved.append((kind, key))
            fetches.append((kind, where, host_id))
        return reserved, fetches

    def _store_entries(self, request: Request) -> list[tuple[str, BlockKey | CheckpointKey, str, int]]:
        """What the store adds to the local tiers' hit: (kind, host-tier key, store key, length) of its blocks past
        the local ones and of the state (and partial block) where the longer hit ends; [] when it adds nothing."""
        assert self.shared is not None
        bs = self.block_size
        hashes = self.hashes(request, (request.num_tokens - 1) // bs)
        local = 0
        while local < len(hashes) and (self.blocks.lookup(hashes[local]) is not None
                                       or self.host.full_block(hashes[local]) is not None):
            local += 1
        stable = self._stable_chain(request, len(hashes))
        # How far the store's blocks reach, by bisection (O(log n) lookups, not one per block): the engines write
        # every block of a chain, so the blocks present form a prefix; where one is missing after all (evicted), its
        # fetch fails and the hit is just shorter.
        end, top = local, len(hashes)
        while end < top:
            mid = (end + top + 1) // 2
            if self.shared.contains(f"kv/{stable[mid - 1]}"):
                end = mid
            else:
                top = mid - 1
        current = self.match(request).length
        wanted: list[tuple[str, BlockKey | CheckpointKey, str, int]] = []
        tail = self._store_tail(request, end, current)
        if tail is not None:  # where an earlier request ended, inside the block after the store's blocks
            length, digest = tail
            boundary, key = end, (parent_hash(hashes, end), tuple(request.cache_token_slice(end * bs, length)))
            wanted = [("kv", key, f"kv/{digest}", 0), ("state", key, f"state/{digest}", length)]
        else:
            step = max(1, (self.checkpoint_interval or bs) // bs)
            # The deepest boundary past the current hit with a state: the end of the blocks, then checkpoint
            # intervals.
            for boundary in sorted({end, *range(end // step * step, current // bs, -step)}, reverse=True):
                if boundary * bs <= current:
                    return []
                ckpt_key = (parent_hash(hashes, boundary), ())
                if self._checkpoint(ckpt_key) is not None:
                    break
                if self.shared.contains(f"state/{stable[boundary - 1]}"):
                    wanted.append(("state", ckpt_key, f"state/{stable[boundary - 1]}", boundary * bs))
                    break
            else:
                return []
        return [("kv", (hashes[b], None), f"kv/{stable[b]}", 0) for b in range(local, boundary)] + wanted

    def _store_tail(self, request: Request, end: int, current: int) -> tuple[int, str] | None:
        """The longest length past `end` full blocks and the current hit, short of the next block boundary, at which
        the store holds a state: where an earlier request with this prefix ended (its state and partial block are
        written when it finishes). Returns (length, digest); one existence check per candidate, longest first (at
        most block_size - 1), after the request's own prompt."""
        assert self.shared is not None
        bs = self.block_size
        top = min(request.num_tokens - 1, (end + 1) * bs - 1)
        for length in range(top, max(end * bs, current), -1):
            digest = self._stable_digest(request, length)
            if self.shared.contains(f"state/{digest}"):
                return length, digest
        return None

    def prefetch_remote(self, request: Request) -> bool:
        """Before admitting `request` on a decode instance: if a prefill instance computed more of its prompt than
        the local tiers hold (`request.remote_prefill`), reserve host-tier entries for the blocks and the state
        that are missing and queue the fetch for this step; True while the request must wait for it (admitted after
        the step, its hit then comes from the host tier, so the state and the blocks arrive through the same path
        as any prefix hit). Tried once per request: a fetch that fails is a local recompute."""
        rid, remote = request.request_id, request.remote_prefill
        if rid in self._fetching:
            return True
        if remote is None or rid in self._probed_remote or not self.host.enabled or request.skip_prefix_cache:
            return False
        self._probed_remote.add(rid)
        bs, length = self.block_size, remote.num_tokens
        if length > request.num_tokens - 1 or self.match(request).length >= length:
            self.remote_skipped += 1
            return False
        full = length // bs
        hashes = self.hashes(request, full)
        parent, tail = parent_hash(hashes, full), tuple(request.cache_token_slice(full * bs, length))
        wanted: list[tuple[str, BlockKey | CheckpointKey, int, int]] = [
            ("kv", (h, None), b, 0) for b, h in enumerate(hashes) if self.blocks.lookup(h) is None]
        if tail and tail not in self.blocks.lookup_partials(parent):
            wanted.append(("kv", (parent, tail), full, 0))
        if self.checkpoints.get(self.key(request, length)) is None:
            wanted.append(("state", self.key(request, length), 0, length))
        held = self._reserve(wanted)
        if held is None:  # no room (everything pinned): recompute instead
            self.remote_skipped += 1
            return False
        reserved, parts = held
        if not parts:
            return False
        self._fetching[rid] = reserved
        self._remote_step.append((rid, reserved))
        self._remote_ops.append(RemoteFetch(request_id=rid, transfer_id=remote.transfer_id, addresses=remote.addresses,
                                            num_blocks=self.blocks_for(length), parts=tuple(parts)))
        return True

    def take_remote_fetches(self) -> list[RemoteFetch]:
        """This step's fetches from prefill instances."""
        out, self._remote_ops = self._remote_ops, []
        return out

    def finish_remote(self, fetched: list[bool]) -> None:
        """After the step that ran this step's remote fetches: publish what every rank got whole (`fetched`, one per
        fetch, in order), drop the rest (those requests recompute)."""
        for i, (rid, reserved) in enumerate(self._remote_step):
            ok = i < len(fetched) and fetched[i]
            self._fetching.pop(rid, None)
            for kind, key in reserved:
                self.host.publish(kind, key, ok)
            if ok:
                self.remote_fetched += 1
            else:
                self.remote_failures += 1
        self._remote_step = []

    def take_shared_ops(self) -> SharedStoreOps | None:
        """This step's puts to and fetches from the shared store (None when there are none)."""
        out, self._shared_ops = self._shared_ops, SharedStoreOps()
        return out if out else None

    def finish_fetches(self, fetched: list[bool]) -> None:
        """After the step that ran this step's fetches: publish the entries every rank got (`fetched`, in fetch
        order), drop the others; the waiting requests are admitted from the next step on."""
        for i, (kind, key) in enumerate(self._step_fetches):
            ok = i < len(fetched) and fetched[i]
            self.host.publish(kind, key, ok)
            if ok:
                self.shared_fetched += 1
            else:
                self.shared_fetch_failures += 1
        self._step_fetches = []
        self._fetching.clear()

    # -- allocation ----------------------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the request hold blocks for `num_tokens` cached tokens and a state slot, starting from `hit`.

        All or nothing: on False nothing changed. The first call for a request allocates its slot; with a hit the
        request also takes the cached blocks and queues the partial-block and state copies for the runner.
        """
        held = self._held.get(request_id)
        if held is not None:
            need = self.blocks_for(num_tokens) - len(held.blocks)
            if need > self.blocks.num_free:
                return False
            if need > 0:
                held.blocks.extend(self.blocks.allocate(need) or [])
            return True
        hit = hit or PrefixHit()
        reused = [b for b in (*hit.blocks, hit.partial_block) if isinstance(b, int)]
        on_device = sum(1 for b in hit.blocks if isinstance(b, int))
        pinned_free = sum(1 for b in set(reused) if self.blocks.is_free(b))
        need = self.blocks_for(num_tokens) - on_device
        if need > self.blocks.num_free - pinned_free or self.slots.num_free == 0:
            return False
        for b in reused:
            self.blocks.touch(b)
        # Pinned before allocating: the device blocks allocated next may demote others into the host tier, which
        # must not evict what this hit is about to copy back.
        for ref in (*hit.blocks, hit.partial_block):
            if isinstance(ref, HostRef):
                self.host.pin_block(ref.key)
        if isinstance(hit.checkpoint, HostRef):
            self.host.pin_checkpoint(hit.checkpoint.key)  # type: ignore[arg-type]  # a CheckpointKey here
        slot = self.slots.take(RUNNING)
        held = self._held[request_id] = _Holding(slot=slot, num_registered=len(hit.blocks))
        self._use_hit(held, hit, self.blocks.allocate(need) or [])
        return True

    def _use_hit(self, held: _Holding, hit: PrefixHit, fresh: list[int]) -> None:
        """Fill a new holding's block list from `hit` and `fresh` blocks, queueing the copies the hit needs: host-tier
        blocks into fresh device blocks (findable there again), the partial block and the checkpoint into the
        request's own block and slot."""
        bs, copies = self.block_size, self._host_copies
        for cached in hit.blocks:
            if isinstance(cached, int):
                held.blocks.append(cached)
                continue
            dev = fresh.pop(0)
            copies.blocks_in.append((cached.host_id, dev, bs))
            self.blocks.cache_full(dev, cached.key[0])
            held.blocks.append(dev)
        held.blocks.extend(fresh)
        part, first_own = hit.partial_block, len(hit.blocks)
        if isinstance(part, int):
            self._block_copies.append((part, held.blocks[first_own], hit.length % bs))
            self._step_blocks.append(part)
        elif part is not None:
            copies.blocks_in.append((part.host_id, held.blocks[first_own], hit.length % bs))
        if isinstance(hit.checkpoint, Checkpoint):
            self._state_copies.append((hit.checkpoint.slot, held.slot))
            hit.checkpoint.pins += 1
            self._step_checkpoints.append(hit.checkpoint)
        elif hit.checkpoint is not None:
            copies.states_in.append((hit.checkpoint.host_id, held.slot))
        if hit.uses_host:
            self._host_hit += hit.length

    def record_query(self, num_prompt_tokens: int, hit_tokens: int) -> None:
        self._queried += num_prompt_tokens
        self._hit += hit_tokens

    def take_copies(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The (src block, dst block, rows) and (src slot, dst slot) copies the runner must do before this step."""
        out = (self._block_copies, self._state_copies)
        self._block_copies, self._state_copies = [], []
        return out

    def end_step(self) -> None:
        """Release what this step's copies pinned (call after the runner executed the step)."""
        self.blocks.free(self._step_blocks)
        for ckpt in self._step_checkpoints:
            ckpt.pins -= 1
        self._step_blocks, self._step_checkpoints = [], []
        self.host.end_step()

    # -- speculative steps ---------------------------------------------------------------------------------------

    def allocate_scratch(self, request_id: str, num_proposed: int) -> list[int] | None:
        """Scratch slots for a step that verifies `num_proposed` proposed tokens after the request's last sampled
        token: slot i receives the state after i + 1 of the step's tokens (the state after all of them stays in the
        running slot). None, with nothing allocated, when the scratch pool cannot hold them all."""
        held = self._held[request_id]
        if held.scratch or self.slots.num_free_of(SCRATCH) < num_proposed:
            return None
        held.scratch = [self.slots.take(SCRATCH) for _ in range(num_proposed)]
        return held.scratch

    def commit_proposed(self, request: Request, num_accepted: int) -> None:
        """After a speculative step kept `num_accepted` proposed tokens (`request.num_computed_tokens` already
        counts them): the state after them becomes the request's running state (by exchanging slot ids, no copy),
        every scratch slot is released, and so are the blocks that only held rejected tokens. KV rows of rejected
        tokens in a kept block lie past `num_computed_tokens`; they are overwritten when those positions are
        computed."""
        held = self._held[request.request_id]
        scratch, held.scratch = held.scratch, []
        if num_accepted < len(scratch):  # the running slot ran past the accepted tokens: take the scratch state
            kept = scratch[num_accepted]
            self.slots.swap_kinds(held.slot, kept)
            scratch[num_accepted], held.slot = held.slot, kept
        for slot in scratch:
            self.slots.free(slot)
        keep = max(self.blocks_for(request.num_computed_tokens), held.num_registered)
        if len(held.blocks) > keep:
            self.blocks.free(held.blocks[keep:][::-1])
            held.blocks.truncate(keep)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def plan_checkpoints(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Reserve checkpoint slots for this request's planned positions in (start, end].

        Planned positions: the last full block of the prompt, and every `checkpoint_interval` tokens of a prefill.
        Returns (position - start, slot) pairs for the runner.
        """
        if not self.enable_prefix_caching or self.slots.num_checkpoint_slots == 0:
            return []
        held = self._held[request.request_id]
        out = []
        # Latest first: when slots run short, the deepest checkpoint serves the most future hits.
        for pos in self._planned_between(request, start, end)[::-1]:
            if self.checkpoints.contains(self.key(request, pos)):
                continue
            slot = self.checkpoints.reserve_slot()
            if slot is None:
                break
            held.pending.append((pos, slot))
            out.append((pos - start, slot))
        return sorted(out)

    def planned_positions(self, request: Request) -> list[int]:
        """Where a prefill of this request saves checkpoints: every `checkpoint_interval` tokens of the prompt
        and its last full block (so an identical or extended prompt hits)."""
        if not self.enable_prefix_caching:
            return []
        return self._planned_between(request, 0, request.num_prompt_tokens)

    def _planned_between(self, request: Request, start: int, end: int) -> list[int]:
        """The planned positions in (start, end], sorted: computed for that range only (a step of a long prefill
        costs its own length, not the prompt's)."""
        if not self.enable_prefix_caching:
            return []
        n, step = request.num_prompt_tokens, self.checkpoint_interval or request.num_prompt_tokens
        wanted = set(range((start // step + 1) * step, min(end, n - 1) + 1, step))
        last_full = (n - 1) // self.block_size * self.block_size
        if start < last_full <= end:
            wanted.add(last_full)
        return sorted(wanted)

    def key(self, request: Request, length: int) -> CheckpointKey:
        """The checkpoint key of the request's first `length` tokens."""
        full = length // self.block_size
        tail = request.cache_token_slice(full * self.block_size, length)
        return parent_hash(self._chain(request, full), full), tuple(tail)

    def commit(self, request: Request) -> None:
        """After a step: make the newly completed full blocks and checkpoints of the request findable."""
        held = self._held.get(request.request_id)
        if held is not None and self.enable_prefix_caching:
            self._commit(request, held)

    def _commit(self, request: Request, held: _Holding) -> None:
        full = request.num_computed_tokens // self.block_size
        if full > held.num_registered:
            hashes = self._chain(request, full)
            stable = self._stable_chain(request, full) if self.shared is not None else []
            for b in range(held.num_registered, full):
                self.blocks.cache_full(held.blocks[b], hashes[b])
                if stable:
                    self._put("kv", f"kv/{stable[b]}", held.blocks[b])
            held.num_registered = full
        done = [(p, s) for p, s in held.pending if p <= request.num_computed_tokens]
        for pos, slot in done:
            self.checkpoints.add(self.key(request, pos), pos, slot)
            self._put_state(request, pos, slot)
        held.pending = [(p, s) for p, s in held.pending if p > request.num_computed_tokens]

    # -- release -------------------------------------------------------------------------------------------------

    def free(self, request: Request, *, save_state: bool = True) -> None:
        """Return the request's blocks and slot. With prefix caching, first keep its state as a checkpoint at
        `num_computed_tokens` (and cache its last partial block), so a continuation or a resumption hits."""
        held = self._held.pop(request.request_id, None)
        self._probed.discard(request.request_id)
        self._probed_remote.discard(request.request_id)
        self._fetching.pop(request.request_id, None)  # its fetches are published (or dropped) after their step
        if held is None:
            self._hashes.pop(request.request_id, None)
            self._stable.pop(request.request_id, None)
            return
        for _, slot in held.pending:  # reserved checkpoints that were never written
            self.slots.free(slot)
        for slot in held.scratch:  # a speculative step that never completed
            self.slots.free(slot)
        kept = False
        length = request.num_computed_tokens
        if self.enable_prefix_caching and save_state and length > 0:
            held.pending = []
            self._commit(request, held)
            kept = self._keep_as_checkpoint(request, held, length)
        # Tail first: the end of a prefix becomes least recently used, so eviction shortens a cached chain from
        # its end instead of breaking it at the start.
        self.blocks.free(held.blocks[::-1])
        if not kept:
            self.slots.free(held.slot)
        self._hashes.pop(request.request_id, None)
        self._stable.pop(request.request_id, None)

    def _keep_as_checkpoint(self, request: Request, held: _Holding, length: int) -> bool:
        bs = self.block_size
        key = self.key(request, length)
        if length % bs:
            self.blocks.cache_partial(held.blocks[length // bs], key[0], key[1])
            if self.shared is not None:  # another replica's next turn of this session resumes here too
                self._put("kv", f"kv/{self._stable_digest(request, length)}", held.blocks[length // bs])
        # Whether or not the device keeps it: the put reads the slot before the next step's forward can reuse it.
        self._put_state(request, length, held.slot)
        if self.checkpoints.contains(key) or self.slots.num_checkpoint_slots == 0 or not self.checkpoints.make_room():
            return False
        self.slots.convert(held.slot, CHECKPOINT)
        self.checkpoints.add(key, length, held.slot)
        return True

    def _put_state(self, request: Request, length: int, slot: int) -> None:
        """Write-through of a checkpoint: at a block boundary (prefill checkpoints) or at the end of a finished
        request (with its partial block, `kv/<digest>` of the same length)."""
        if self.shared is not None:
            self._put("state", f"state/{self._stable_digest(request, length)}", slot)

    def has_pending_puts(self) -> bool:
        """Whether writes to the shared store wait for a step (which an idle engine must still run)."""
        return bool(self._shared_ops.puts)

    # -- introspection -------------------------------------------------------------------------------------------

    def slot(self, request_id: str) -> int:
        return self._held[request_id].slot

    def block_ids(self, request_id: str) -> BlockList:
        """The request's blocks: its live list (appended as it grows, truncated by a rejected proposal)."""
        return self._held[request_id].blocks

    def usage(self) -> CacheUsage:
        """Free counts; cached-but-unreferenced blocks count as free (they are evicted on demand)."""
        return CacheUsage(num_blocks=self.blocks.num_blocks, num_free_blocks=self.blocks.num_free,
                          num_slots=self.slots.num_slots, num_free_slots=self.slots.num_free)

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached KV block and every unpinned state checkpoint (benchmarks flush between rounds).

        Running requests keep what they hold; outputs do not change, later requests just miss. Returns
        (blocks uncached, checkpoints dropped)."""
        self.host.clear()
        return self.blocks.reset_cache(), self.checkpoints.clear()

    def prefix_stats(self) -> PrefixCacheStats:
        n = len(self.checkpoints)
        return PrefixCacheStats(
            queried_tokens=self._queried, hit_tokens=self._hit, checkpoints_stored=n,
            checkpoints_created=self.checkpoints.num_stored_total, checkpoint_bytes=n * self.bytes_per_slot,
            cached_blocks=self.blocks.num_cached, block_evictions=self.blocks.num_evictions,
            checkpoint_evictions=self.checkpoints.num_evictions, host_hit_tokens=self._host_hit,
            host_blocks=len(self.host.blocks.entries), host_checkpoints=len(self.host.checkpoints.entries),
            host_blocks_demoted=self.host.demoted_blocks, host_checkpoints_demoted=self.host.demoted_checkpoints,
            host_blocks_promoted=self.host.promoted_blocks, host_checkpoints_promoted=self.host.promoted_checkpoints,
        )
