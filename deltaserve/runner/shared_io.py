"""A worker rank's traffic with the shared store (L3): its part of each block and state written through from the
device caches (in a background thread, so a slow store never holds a step up), and fetched into the host tier (read
from the store in another thread while the step computes, written into the host tier after the forward)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from deltaserve.cache.manager import SharedStoreOps
from deltaserve.kvstore.store import KVStoreStats
from deltaserve.layers.forward_batch import KDALayerCache, LayerCache, MLALayerCache

logger = logging.getLogger(__name__)

MAX_QUEUED_PUTS = 4096
"""Puts waiting for the background thread; past it new ones are dropped (a store slower than the engine)."""


class ByteStore(Protocol):
    """What this needs of a `kvstore.KVStore`."""

    def put(self, key: str, value: bytes) -> bool: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @property
    def stats(self) -> KVStoreStats: ...


def _parts(caches: Sequence[LayerCache], kind: str, index: int) -> list[torch.Tensor]:
    """The tensors of one entry, in a fixed order: every MLA layer's block (`kv`), or every KDA layer's recurrent
    state then conv window (`state`)."""
    if kind == "kv":
        return [c.kv[index] for c in caches if isinstance(c, MLALayerCache)]
    out = []
    for c in caches:
        if isinstance(c, KDALayerCache):
            out += [c.state[index], c.conv[index]]
    return out


def entry_bytes(caches: Sequence[LayerCache], kind: str) -> int:
    """Bytes of one entry of `kind` (this rank's part)."""
    return sum(t.numel() * t.element_size() for t in _parts(caches, kind, 0))


def _stacks(caches: Sequence[LayerCache], kind: str) -> list[torch.Tensor]:
    """The pool tensors `_parts` indexes, in the same order."""
    if kind == "kv":
        return [c.kv for c in caches if isinstance(c, MLALayerCache)]
    return [t for c in caches if isinstance(c, KDALayerCache) for t in (c.state, c.conv)]


def pack_many(caches: Sequence[LayerCache], kind: str, indices: Sequence[int]) -> bytes:
    """The entries at `indices`, one after the other, each laid out as `pack` lays it out: one gather per layer
    instead of one small copy per entry and layer (a 32K-token prompt has 2,048 blocks)."""
    if not indices:
        return b""
    index = torch.tensor(list(indices), dtype=torch.long)
    rows = [t.index_select(0, index.to(t.device)).view(torch.uint8).reshape(len(indices), -1).cpu()
            for t in _stacks(caches, kind)]
    return torch.cat(rows, dim=1).numpy().tobytes()


def unpack_many(data: bytes | memoryview, caches: Sequence[LayerCache], kind: str, indices: Sequence[int]) -> bool:
    """Write `len(indices)` consecutive entries of `data` (as `pack_many` made them) into `caches` at `indices`;
    False (nothing written) when the length does not match exactly."""
    stacks = _stacks(caches, kind)
    widths = [t[0].numel() * t.element_size() for t in stacks]
    if len(data) != len(indices) * sum(widths):
        return False
    if not indices:
        return True
    rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(indices), -1)
    index = torch.tensor(list(indices), dtype=torch.long)
    offset = 0
    for t, width in zip(stacks, widths, strict=True):
        part = rows[:, offset:offset + width].contiguous().view(t.dtype).reshape(len(indices), *t.shape[1:])
        t.index_copy_(0, index.to(t.device), part.to(t.device))
        offset += width
    return True


def pack(caches: Sequence[LayerCache], kind: str, index: int) -> bytes:
    """One entry's bytes (this rank's part)."""
    flat = [t.detach().contiguous().view(torch.uint8).reshape(-1).cpu() for t in _parts(caches, kind, index)]
    return torch.cat(flat).numpy().tobytes()


def unpack(data: bytes | memoryview, caches: Sequence[LayerCache], kind: str, index: int) -> bool:
    """Write an entry's bytes into `caches`; False (nothing trusted) when the length does not match exactly."""
    targets = _parts(caches, kind, index)
    if len(data) != sum(t.numel() * t.element_size() for t in targets):
        return False
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset = 0
    for t in targets:
        n = t.numel() * t.element_size()
        t.view(torch.uint8).reshape(-1).copy_(buf[offset:offset + n])
        offset += n
    return True


def rank_suffix(rank: int, size: int) -> str:
    """What rank `rank` of `size` appends to every key: each rank stores its own part (its heads' states)."""
    return f"/r{rank}of{size}"


@dataclass(frozen=True, slots=True)
class PendingStoreFetches:
    """A step's shared-store fetches being read (`SharedStoreIO.start`)."""

    fetches: tuple[tuple[str, str, int], ...]
    """(kind, key, host-tier block or slot) of each."""
    entries: Future[list[bytes | None]] | None
    """Each fetch's entry once read (None: nothing to read, or no host tier to write into)."""
    host_caches: Sequence[LayerCache] | None


class SharedStoreIO:
    """Rank `rank` of `size`'s reads and writes (keys end in `rank_suffix`)."""

    def __init__(self, store: ByteStore, rank: int, size: int) -> None:
        self.store, self.suffix = store, rank_suffix(rank, size)
        self._puts: queue.Queue[tuple[str, bytes] | None] = queue.Queue(MAX_QUEUED_PUTS)
        self._thread = threading.Thread(target=self._put_loop, name="shared-store-puts", daemon=True)
        self._thread.start()
        self.dropped_puts = 0
        self._gets: ThreadPoolExecutor | None = None

    def start(self, ops: SharedStoreOps, caches: Sequence[LayerCache], host_caches: Sequence[LayerCache] | None
              ) -> PendingStoreFetches:
        """Before the step's forward: queue the puts (read from `caches` now, before the step writes), and start
        reading the fetches' entries; `finish` writes them into `host_caches` after the forward."""
        for kind, key, where in ops.puts:
            try:
                self._puts.put_nowait((key + self.suffix, pack(caches, kind, where)))
            except queue.Full:
                self.dropped_puts += 1
        fetches = tuple(ops.fetches)
        if not fetches or host_caches is None:
            return PendingStoreFetches(fetches, None, host_caches)
        if self._gets is None:
            self._gets = ThreadPoolExecutor(1, thread_name_prefix="shared-store-gets")
        keys = [key + self.suffix for _, key, _ in fetches]
        return PendingStoreFetches(fetches, self._gets.submit(self.store.get_many, keys), host_caches)

    def finish(self, pending: PendingStoreFetches) -> list[bool]:
        """After the step's forward: wait for the reads `start` began (each bounded by the store's timeout) and write
        them into the host tier; per fetch, whether it arrived whole and of the right size (the store itself checks
        each entry's checksum)."""
        if pending.entries is None or pending.host_caches is None:
            return [False] * len(pending.fetches)
        host_caches = pending.host_caches
        return [data is not None and unpack(data, host_caches, kind, host_id)
                for (kind, _, host_id), data in zip(pending.fetches, pending.entries.result(), strict=True)]

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued put was attempted (tests, shutdown)."""
        done = threading.Event()

        def wait() -> None:
            self._puts.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout_s)

    def close(self) -> None:
        self._puts.put(None)

    def _put_loop(self) -> None:
        while True:
            item = self._puts.get()
            try:
                if item is None:
                    return
                self.store.put(*item)  # never raises: a failing store is counted in its stats
            finally:
                self._puts.task_done()
