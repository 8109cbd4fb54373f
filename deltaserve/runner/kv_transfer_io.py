"""A worker rank's side of prefill/decode disaggregation: publish a request's cache (its KV blocks and the KDA
state and conv window after its prompt, this rank's part) on the rank's transfer server, and fetch another
instance's into the host tier.

Each payload is framed as a `kvstore.entry` (the cache layout's namespace, the transfer id and rank, the length and
a CRC-32), so a payload cut short, altered, or from an instance with another model, dtype, block size or
tensor-parallel split is refused on arrival, whatever the transport; the request is then recomputed."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from deltaserve.cache.remote import RemoteFetch, TransferResult
from deltaserve.kvstore.entry import decode_entry, encode
from deltaserve.kvtransfer.transport import TransferClient, TransferServer
from deltaserve.layers.forward_batch import LayerCache
from deltaserve.runner.shared_io import entry_bytes, pack, pack_many, rank_suffix, unpack, unpack_many
from deltaserve.scheduler.output import ScheduledChunk

logger = logging.getLogger(__name__)


class KVTransferIO:
    """Rank `rank` of `size`: the producer's `server` (None on a decode-only instance) and the consumer's `client`
    (None on a prefill-only instance)."""

    def __init__(self, *, namespace: str, rank: int, size: int, block_size: int, server: TransferServer | None,
                 client: TransferClient | None, timeout_s: float, ttl_s: float) -> None:
        self.namespace, self.rank, self.suffix = namespace, rank, rank_suffix(rank, size)
        self.block_size, self.server, self.client = block_size, server, client
        self.timeout_s, self.ttl_s = timeout_s, ttl_s

    def fetch(self, fetches: Sequence[RemoteFetch], caches: Sequence[LayerCache],
              host_caches: Sequence[LayerCache] | None) -> TransferResult:
        """Before the step's forward: each fetch into its reserved `host_caches` entries (`caches` give the sizes)."""
        start = time.perf_counter()
        kv = state = 0
        fetched = []
        for f in fetches:
            got = self._fetch(f, caches, host_caches)
            fetched.append(got is not None)
            if got is not None:
                kv, state = kv + got[0], state + got[1]
        return TransferResult(fetched=fetched, received=(kv, state), seconds=time.perf_counter() - start)

    def publish(self, sends: Sequence[ScheduledChunk], caches: Sequence[LayerCache]) -> dict[str, tuple[int, int]]:
        """After the forward: publish the device caches of `sends` (chunks that ended a prefill request's prompt);
        per request, (KV bytes, state bytes) of this rank's payload."""
        return {c.request_id: self._send(c, caches) for c in sends if c.kv_send is not None}

    def _send(self, chunk: ScheduledChunk, caches: Sequence[LayerCache]) -> tuple[int, int]:
        if self.server is None:
            raise RuntimeError("a cache to publish, but this instance is not a kv_producer")
        assert chunk.kv_send is not None
        num_tokens = chunk.num_computed_tokens + len(chunk.new_token_ids)
        blocks = pack_many(caches, "kv", chunk.block_ids[:math.ceil(num_tokens / self.block_size)])
        state = pack(caches, "state", chunk.state_slot)
        key = chunk.kv_send + self.suffix
        self.server.publish(key, encode(self.namespace, key, blocks + state, ttl_s=self.ttl_s))
        return len(blocks), len(state)

    def _fetch(self, f: RemoteFetch, caches: Sequence[LayerCache], host_caches: Sequence[LayerCache] | None
               ) -> tuple[int, int] | None:
        """(KV bytes, state bytes) written, or None when the payload did not arrive whole and checked."""
        if self.client is None or host_caches is None or self.rank >= len(f.addresses):
            return None
        key = f.transfer_id + self.suffix
        raw = self.client.fetch(f.addresses[self.rank], key, self.timeout_s)
        if raw is None:
            logger.warning("transfer %s: nothing fetched from %s (recomputing)", key, f.addresses[self.rank])
            return None
        payload, refusal = decode_entry(raw, self.namespace, key)
        block_bytes, state_bytes = entry_bytes(caches, "kv"), entry_bytes(caches, "state")
        if payload is None or len(payload) != f.num_blocks * block_bytes + state_bytes:
            why = refusal.value if refusal is not None else f"{len(payload or b'')} bytes, expected " \
                f"{f.num_blocks} blocks of {block_bytes} + a state of {state_bytes}"
            logger.warning("transfer %s refused (%s): recomputing", key, why)
            return None
        view = memoryview(payload)
        blocks = [(index, host_id) for kind, index, host_id in f.parts if kind == "kv"]
        # The wanted blocks are usually a run (the tail the decode side lacks): one gather-free slice then.
        indices = [i for i, _ in blocks]
        if indices and indices == list(range(indices[0], indices[0] + len(indices))):
            data: bytes | memoryview = view[indices[0] * block_bytes:(indices[-1] + 1) * block_bytes]
        else:
            data = b"".join(view[i * block_bytes:(i + 1) * block_bytes] for i in indices)
        if not unpack_many(data, host_caches, "kv", [h for _, h in blocks]):
            return None
        states = [host_id for kind, _, host_id in f.parts if kind == "state"]
        for host_id in states:
            if not unpack(view[f.num_blocks * block_bytes:], host_caches, "state", host_id):
                return None
        return len(blocks) * block_bytes, len(states) * state_bytes
