"""The step operations of prefill/decode disaggregation that the runner carries out: a prefill instance publishes
a request's cache after the step that computed its prompt, a decode instance fetches one into host-tier entries
reserved for it (`CacheManager.prefetch_remote`), which the scheduler publishes after the step if every rank got
its part. Rank r's payload holds, in order, its KV blocks (blocks r, r + size, ... of those covering the
transferred tokens, the last one partial when they end inside a block: the latent cache is whole on every rank, so
each block moves once and the decode ranks all-gather them) and its heads' KDA state after them, each in
`runner/shared_io.py`'s entry layout."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteFetch:
    """One request's cache to fetch from a prefill instance."""

    request_id: str
    transfer_id: str
    addresses: tuple[str, ...]
    """The producer's transfer server of each rank (rank r fetches from addresses[r])."""
    num_blocks: int
    """KV blocks covering the transferred tokens (over all ranks' payloads)."""
    parts: tuple[tuple[str, int, int], ...]
    """(kind 'kv' or 'state', block index in the payload (0 for the state), host-tier block or slot) to write."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferResult:
    """What a rank did with the step's transfers."""

    fetched: list[bool] = field(default_factory=list)
    """Per `RemoteFetch` of the step, in order: whether the payload arrived whole and checked (every rank's, once
    the worker has combined the ranks' answers)."""
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per request whose cache was published: (KV bytes of all ranks' payloads together, state bytes of this
    rank's)."""
    received: tuple[int, int] = (0, 0)
    """KV bytes written into the host tier by this step's fetches (the same on every rank: all blocks, gathered)
    and this rank's state bytes."""
    seconds: float = 0.0
    """Wall time of this step's fetches and sends."""
