"""A worker rank's side of prefill/decode disaggregation: publish a request's cache (its KV blocks and the KDA
state and conv window after its prompt, this rank's part) on the rank's transfer server, and fetch another
instance's into the host tier.

With tensor parallelism the MLA latent cache is whole on every rank, so each block crosses the network once:
rank r publishes and fetches blocks r, r + size, ... and the decode side's ranks all-gather the blocks they fetched
(over the tensor-parallel group: NVLink or the host, not the network). The KDA state is split by heads: each rank
moves its own.

A fetch is started before the step's forward (`start_fetch`: the download and the check run in a thread of their
own, while the step computes the running requests) and finished after it (`finish_fetch`: the exchange between
ranks and the writes into the host tier, on the step's thread), so a step lasts the longer of its forward and its
fetches, not their sum.

Each payload is framed as a `kvstore.entry` (the cache layout's namespace, the transfer id and rank, the length and
a CRC-32), so a payload cut short, altered, or from an instance with another model, dtype, block size or
tensor-parallel split is refused on arrival, whatever the transport; the request is then recomputed."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deltaserve.cache.remote import RemoteFetch, TransferResult
from deltaserve.kvstore.entry import decode_entry, encode
from deltaserve.kvtransfer.transport import TransferClient, TransferServer
from deltaserve.layers.forward_batch import LayerCache
from deltaserve.runner.shared_io import entry_bytes, pack, pack_many, rank_suffix, unpack, unpack_many
from deltaserve.scheduler.output import ScheduledChunk

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingFetches:
    """A step's fetches whose payloads are downloading (`KVTransferIO.start_fetch`)."""

    fetches: tuple[RemoteFetch, ...]
    payloads: Future[tuple[list[bytes | memoryview | None], float]]
    """This rank's checked payload of each fetch (None: it did not arrive whole), and the seconds it took."""


class KVTransferIO:
    """Rank `rank` of `size`: the producer's `server` (None on a decode-only instance) and the consumer's `client`
    (None on a prefill-only instance)."""

    def __init__(self, *, namespace: str, rank: int, size: int, block_size: int, server: TransferServer | None,
                 client: TransferClient | None, timeout_s: float, ttl_s: float,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`all_gather`: the tensor-parallel group's all-gather of a 1-D uint8 tensor (every rank's, concatenated in
        rank order); needed when `size` > 1 on a consumer."""
        self.namespace, self.rank, self.size, self.suffix = namespace, rank, size, rank_suffix(rank, size)
        self.block_size, self.server, self.client = block_size, server, client
        self.timeout_s, self.ttl_s = timeout_s, ttl_s
        self.all_gather = all_gather
        if size > 1 and client is not None and all_gather is None:
            raise ValueError("a tensor-parallel consumer needs the group's all_gather")
        self._downloads: ThreadPoolExecutor | None = None

    def start_fetch(self, fetches: Sequence[RemoteFetch], caches: Sequence[LayerCache],
                    host_caches: Sequence[LayerCache] | None) -> PendingFetches:
        """Before the step's forward: start downloading this rank's payload of each fetch (`caches` give the
        sizes to check them against); nothing is written yet."""
        usable = self.client is not None and host_caches is not None
        block_bytes, state_bytes = entry_bytes(caches, "kv"), entry_bytes(caches, "state")

        def download() -> tuple[list[bytes | memoryview | None], float]:
            start = time.perf_counter()
            out = [self._own_payload(f, block_bytes, state_bytes) if usable else None for f in fetches]
            return out, time.perf_counter() - start

        if self._downloads is None:
            self._downloads = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")
        return PendingFetches(tuple(fetches), self._downloads.submit(download))

    def finish_fetch(self, pending: PendingFetches, caches: Sequence[LayerCache],
                     host_caches: Sequence[LayerCache] | None) -> TransferResult:
        """After the step's forward: wait for the downloads, exchange the blocks between ranks and write each fetch
        into its reserved `host_caches` entries. `received`: the KV bytes written on every rank (each block fetched
        by one rank) and this rank's state bytes. Every rank makes the same collective calls whatever it fetched."""
        payloads, seconds = pending.payloads.result()  # each download is bounded by timeout_s
        start = time.perf_counter()
        kv = state = 0
        fetched = []
        for f, own in zip(pending.fetches, payloads, strict=True):
            got = self._place(f, own, caches, host_caches)
            fetched.append(got is not None)
            if got is not None:
                kv, state = kv + got[0], state + got[1]
        return TransferResult(fetched=fetched, received=(kv, state),
                              seconds=seconds + time.perf_counter() - start)

    def publish(self, sends: Sequence[ScheduledChunk], caches: Sequence[LayerCache]) -> dict[str, tuple[int, int]]:
        """After the forward: publish the device caches of `sends` (chunks that ended a prefill request's prompt);
        per request, (KV bytes published by all ranks together, state bytes of this rank's payload)."""
        return {c.request_id: self._send(c, caches) for c in sends if c.kv_send is not None}

    def _send(self, chunk: ScheduledChunk, caches: Sequence[LayerCache]) -> tuple[int, int]:
        if self.server is None:
            raise RuntimeError("a cache to publish, but this instance is not a kv_producer")
        assert chunk.kv_send is not None
        num_tokens = chunk.num_computed_tokens + len(chunk.new_token_ids)
        block_ids = chunk.block_ids[:math.ceil(num_tokens / self.block_size)]
        blocks = pack_many(caches, "kv", block_ids[self.rank::self.size])
        state = pack(caches, "state", chunk.state_slot)
        key = chunk.kv_send + self.suffix
        self.server.publish(key, encode(self.namespace, key, blocks + state, ttl_s=self.ttl_s))
        return len(block_ids) * entry_bytes(caches, "kv"), len(state)

    def _place(self, f: RemoteFetch, own: bytes | memoryview | None, caches: Sequence[LayerCache],
               host_caches: Sequence[LayerCache] | None) -> tuple[int, int] | None:
        """Write fetch `f` (this rank's payload `own`) into the host tier: (KV bytes written on all ranks, state
        bytes written here), or None when some rank's payload did not arrive whole and checked."""
        block_bytes = entry_bytes(caches, "kv")
        wanted = [(index, host_id) for kind, index, host_id in f.parts if kind == "kv"]
        if own is None:
            mine = None
        else:
            view = memoryview(own)
            # This rank's payload holds blocks rank, rank + size, ...: block i is its (i // size)-th.
            mine = b"".join(view[(i // self.size) * block_bytes:(i // self.size + 1) * block_bytes]
                            for i, _ in sorted(wanted, key=self._gather_order) if i % self.size == self.rank)
        blocks = self._exchange(wanted, mine, block_bytes) if self.size > 1 else mine
        if own is None or blocks is None or host_caches is None:
            return None
        if not unpack_many(blocks, host_caches, "kv", [h for _, h in sorted(wanted, key=self._gather_order)]):
            return None
        states = [host_id for kind, _, host_id in f.parts if kind == "state"]
        for host_id in states:
            if not unpack(memoryview(own)[self._own_blocks(f.num_blocks) * block_bytes:], host_caches, "state",
                          host_id):
                return None
        return len(wanted) * block_bytes, len(states) * entry_bytes(caches, "state")

    def _own_blocks(self, num_blocks: int) -> int:
        """Blocks of a `num_blocks` payload this rank publishes and fetches."""
        return len(range(self.rank, num_blocks, self.size))

    def _gather_order(self, part: tuple[int, int]) -> tuple[int, int]:
        """Where a wanted block's bytes sit after `_exchange`: by owning rank, then in order."""
        return part[0] % self.size, part[0]

    def _own_payload(self, f: RemoteFetch, block_bytes: int, state_bytes: int) -> bytes | memoryview | None:
        """This rank's payload (its blocks, then its state), checked; None when it did not arrive whole."""
        if self.client is None or self.rank >= len(f.addresses):
            return None
        key = f.transfer_id + self.suffix
        raw = self.client.fetch(f.addresses[self.rank], key, self.timeout_s)
        if raw is None:
            logger.warning("transfer %s: nothing fetched from %s (recomputing)", key, f.addresses[self.rank])
            return None
        payload, refusal = decode_entry(raw, self.namespace, key)
        expected = self._own_blocks(f.num_blocks) * block_bytes + state_bytes
        if payload is None or len(payload) != expected:
            why = refusal.value if refusal is not None else f"{len(payload or b'')} bytes, expected {expected}"
            logger.warning("transfer %s refused (%s): recomputing", key, why)
            return None
        return payload

    def _exchange(self, wanted: list[tuple[int, int]], mine: bytes | None, block_bytes: int) -> bytes | None:
        """Every rank's wanted blocks, ordered by `_gather_order`, from an all-gather of what each rank fetched
        (a flag byte, then its blocks, padded to the largest share); None on every rank when any rank's fetch
        failed."""
        assert self.all_gather is not None
        counts = [sum(1 for i, _ in wanted if i % self.size == r) for r in range(self.size)]
        width = 1 + max(counts) * block_bytes
        local = torch.zeros(width, dtype=torch.uint8)
        if mine is not None:
            local[0] = 1
            if mine:
                local[1:1 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        every = self.all_gather(local).reshape(self.size, width)
        if not bool(every[:, 0].all()):
            return None
        return b"".join(every[r, 1:1 + counts[r] * block_bytes].numpy().tobytes() for r in range(self.size))
