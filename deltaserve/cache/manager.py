"""`CacheManager`: the scheduler's only door to memory.

It owns the KV block pool (with its prefix-hash table), the state slot pool (running and checkpoint slots) and the
checkpoint index. Admission is all or nothing on both pools. With prefix caching on, a prompt's hit of length L
needs cached KV blocks covering [0, L) and a state checkpoint at exactly L; the request then holds the cached full
blocks, gets a copy of a cached partial block and a copy of the checkpoint in its own slot. The copies are handed
to the runner as step operations (`take_copies`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltaserve.cache.block_hash import chain_hashes, parent_hash
from deltaserve.cache.block_pool import BlockList, BlockPool
from deltaserve.cache.prefix_index import Checkpoint, CheckpointIndex, CheckpointKey
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


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """The longest reusable prefix of a request: blocks and a checkpoint, both for exactly `length` tokens."""

    length: int = 0
    blocks: tuple[int, ...] = ()
    """Cached full blocks covering [0, length // block_size * block_size)."""
    partial_block: int | None = None
    """Cached block whose first length % block_size rows continue the prefix (copied, never written)."""
    checkpoint: Checkpoint | None = None


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


class CacheManager:
    """Tracks which KV blocks and which state slot each request holds, and the prefix cache."""

    def __init__(self, *, num_blocks: int, num_slots: int, block_size: int, num_checkpoint_slots: int = 0,
                 bytes_per_slot: int = 0, enable_prefix_caching: bool = False,
                 checkpoint_interval: int | None = None, num_scratch_slots: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.checkpoint_interval = checkpoint_interval
        self.bytes_per_slot = bytes_per_slot
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots, num_checkpoint_slots if enable_prefix_caching else 0, num_scratch_slots)
        self.checkpoints = CheckpointIndex(self.slots)
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
            tokens = request.token_slice(len(hashes) * bs, num_blocks * bs)
            hashes.extend(chain_hashes(tokens, bs, parent=parent_hash(hashes, len(hashes))))
        return hashes

    def match(self, request: Request) -> PrefixHit:
        """The longest prefix with cached KV and a checkpoint at its end; at least one token is left to compute.
        None for a request with `skip_prefix_cache`."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return PrefixHit()
        bs, limit = self.block_size, request.num_tokens - 1
        hashes = self.hashes(request, limit // bs)
        blocks: list[int] = []
        for h in hashes:
            b = self.blocks.lookup(h)
            if b is None:
                break
            blocks.append(b)
        for j in range(len(blocks), -1, -1):
            parent = parent_hash(hashes, j)
            best: tuple[int, int, Checkpoint] | None = None
            for tokens, block in self.blocks.lookup_partials(parent).items():
                length = j * bs + len(tokens)
                if length > limit or (best and len(tokens) <= best[0] - j * bs):
                    continue
                ckpt = self.checkpoints.get((parent, tokens))
                if ckpt is not None and tuple(request.token_slice(j * bs, length)) == tokens:
                    best = (length, block, ckpt)
            if best is not None:
                return PrefixHit(length=best[0], blocks=tuple(blocks[:j]), partial_block=best[1], checkpoint=best[2])
            ckpt = self.checkpoints.get((parent, ())) if j else None
            if ckpt is not None:
                return PrefixHit(length=j * bs, blocks=tuple(blocks[:j]), checkpoint=ckpt)
        return PrefixHit()

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
        reused = list(hit.blocks) + ([hit.partial_block] if hit.partial_block is not None else [])
        pinned_free = sum(1 for b in set(reused) if self.blocks.is_free(b))
        need = self.blocks_for(num_tokens) - len(hit.blocks)
        if need > self.blocks.num_free - pinned_free or self.slots.num_free == 0:
            return False
        for b in reused:
            self.blocks.touch(b)
        slot = self.slots.take(RUNNING)
        held = self._held[request_id] = _Holding(slot=slot, blocks=BlockList(hit.blocks),
                                                 num_registered=len(hit.blocks))
        held.blocks.extend(self.blocks.allocate(need) or [])
        if hit.partial_block is not None:
            self._block_copies.append((hit.partial_block, held.blocks[len(hit.blocks)], hit.length % self.block_size))
            self._step_blocks.append(hit.partial_block)
        if hit.checkpoint is not None:
            self._state_copies.append((hit.checkpoint.slot, slot))
            hit.checkpoint.pins += 1
            self._step_checkpoints.append(hit.checkpoint)
        return True

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
        return parent_hash(self._chain(request, full), full), tuple(request.token_slice(full * self.block_size, length))

    def commit(self, request: Request) -> None:
        """After a step: make the newly completed full blocks and checkpoints of the request findable."""
        held = self._held.get(request.request_id)
        if held is not None and self.enable_prefix_caching:
            self._commit(request, held)

    def _commit(self, request: Request, held: _Holding) -> None:
        full = request.num_computed_tokens // self.block_size
        if full > held.num_registered:
            hashes = self._chain(request, full)
            for b in range(held.num_registered, full):
                self.blocks.cache_full(held.blocks[b], hashes[b])
            held.num_registered = full
        done = [(p, s) for p, s in held.pending if p <= request.num_computed_tokens]
        for pos, slot in done:
            self.checkpoints.add(self.key(request, pos), pos, slot)
        held.pending = [(p, s) for p, s in held.pending if p > request.num_computed_tokens]

    # -- release -------------------------------------------------------------------------------------------------

    def free(self, request: Request, *, save_state: bool = True) -> None:
        """Return the request's blocks and slot. With prefix caching, first keep its state as a checkpoint at
        `num_computed_tokens` (and cache its last partial block), so a continuation or a resumption hits."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            self._hashes.pop(request.request_id, None)
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

    def _keep_as_checkpoint(self, request: Request, held: _Holding, length: int) -> bool:
        bs = self.block_size
        key = self.key(request, length)
        if length % bs:
            self.blocks.cache_partial(held.blocks[length // bs], key[0], key[1])
        if self.checkpoints.contains(key) or self.slots.num_checkpoint_slots == 0 or not self.checkpoints.make_room():
            return False
        self.slots.convert(held.slot, CHECKPOINT)
        self.checkpoints.add(key, length, held.slot)
        return True

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
        return self.blocks.reset_cache(), self.checkpoints.clear()

    def prefix_stats(self) -> PrefixCacheStats:
        n = len(self.checkpoints)
        return PrefixCacheStats(
            queried_tokens=self._queried, hit_tokens=self._hit, checkpoints_stored=n,
            checkpoints_created=self.checkpoints.num_stored_total, checkpoint_bytes=n * self.bytes_per_slot,
            cached_blocks=self.blocks.num_cached, block_evictions=self.blocks.num_evictions,
            checkpoint_evictions=self.checkpoints.num_evictions,
        )
