"""The host tier's tensors (L2 of the prefix cache): per layer, host KV blocks and host state slots, and the copies
between them and the device caches that the scheduler queues (`cache.host_tier.HostCopies`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.cache.host_tier import HostCopies
from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.layers.forward_batch import KDALayerCache, LayerCache, MLALayerCache
from deltaserve.runner.kv_tensors import allocate_layer_caches


class HostCache:
    """Host copies of `num_blocks` KV blocks and `num_slots` state slots for every layer, in host memory (pinned on
    a GPU machine, so the copies are DMA transfers that can overlap compute)."""

    def __init__(self, specs: Sequence[KVCacheSpec | StateCacheSpec], *, num_blocks: int, num_slots: int,
                 block_size: int, device: torch.device) -> None:
        self.caches = allocate_layer_caches(specs, num_blocks=max(num_blocks, 1), block_size=block_size,
                                            num_slots=max(num_slots, 1), device="cpu")
        if device.type == "cuda":
            self.caches = [_pinned(c) for c in self.caches]
        self.bytes_out = self.bytes_in = 0

    def apply(self, copies: HostCopies, device_caches: Sequence[LayerCache]) -> None:
        """Device -> host first (the device memory may be reused by this step), then host -> device."""
        for host, dev in zip(self.caches, device_caches, strict=True):
            if isinstance(host, KDALayerCache) and isinstance(dev, KDALayerCache):
                self.bytes_out += _copy_rows(dev.state, host.state, copies.states_out)
                self.bytes_out += _copy_rows(dev.conv, host.conv, copies.states_out)
                self.bytes_in += _copy_rows(host.state, dev.state, copies.states_in)
                self.bytes_in += _copy_rows(host.conv, dev.conv, copies.states_in)
            elif isinstance(host, MLALayerCache) and isinstance(dev, MLALayerCache):
                self.bytes_out += _copy_rows(dev.kv, host.kv, copies.blocks_out)
                for src, dst, rows in copies.blocks_in:
                    dev.kv[dst, :rows].copy_(host.kv[src, :rows], non_blocking=True)
                    self.bytes_in += rows * host.kv.shape[-1] * host.kv.element_size()


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> int:
    """dst[j] = src[i] for every (i, j), as one gather and one scatter; returns the bytes moved."""
    if not pairs:
        return 0
    i = torch.tensor([p[0] for p in pairs], device=src.device)
    j = torch.tensor([p[1] for p in pairs], device=dst.device)
    dst.index_copy_(0, j, src.index_select(0, i).to(dst.device, non_blocking=True))
    return len(pairs) * src[0].numel() * src.element_size()


def _pinned(cache: LayerCache) -> LayerCache:
    if isinstance(cache, KDALayerCache):
        return KDALayerCache(cache.state.pin_memory(), cache.conv.pin_memory())
    return MLALayerCache(cache.kv.pin_memory())
