"""Opening the shared store (L3) for an engine: one namespace per model and cache layout, so that engines serving
different models, dtypes, block sizes or tensor-parallel splits never share entries."""

from __future__ import annotations

import hashlib
from pathlib import Path

from deltaserve.config import EngineConfig
from deltaserve.kvstore import KVStore, fingerprint, open_store
from deltaserve.runner.shared_io import rank_suffix

LAYOUT_VERSION = 1
"""Bumped when the bytes of an entry change meaning (runner/shared_io.py's layout)."""


def shared_namespace(config: EngineConfig) -> str:
    """The fingerprint of what makes an entry reusable: the checkpoint's config.json and weights index, the dtype,
    the block size, the tensor-parallel size and the entry layout."""
    model = Path(config.model)
    files = {name: hashlib.blake2b((model / name).read_bytes(), digest_size=16).hexdigest()
             for name in ("config.json", "model.safetensors.index.json") if (model / name).is_file()}
    return fingerprint({"files": files, "dtype": config.dtype, "block_size": config.cache.block_size,
                        "tp": config.parallel.tensor_parallel_size, "ep": config.parallel.enable_expert_parallel,
                        "layout": LAYOUT_VERSION})


class RankZeroLookup:
    """The scheduler's view of the store: whether rank 0's part of an entry exists (a fetch then checks every
    rank's)."""

    def __init__(self, store: KVStore, world_size: int) -> None:
        self.store, self.suffix = store, rank_suffix(0, world_size)

    def contains(self, key: str) -> bool:
        return self.store.contains(key + self.suffix)


def open_shared_store(config: EngineConfig) -> KVStore | None:
    """The configured shared store bound to this engine's namespace, or None when none is configured. Connects
    lazily: an unreachable store opens fine and misses until it answers."""
    cc = config.cache
    if cc.shared_cache_url is None or not cc.enable_prefix_caching:
        return None
    return open_store(cc.shared_cache_url, shared_namespace(config), timeout_s=cc.shared_cache_timeout_s)
