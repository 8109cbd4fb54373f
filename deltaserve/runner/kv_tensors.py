"""Allocate the device tensors of every layer's cache from the model's cache specs and the pool sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.layers.forward_batch import KDALayerCache, LayerCache, MLALayerCache


def allocate_layer_caches(
    specs: Sequence[KVCacheSpec | StateCacheSpec],
    *,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    device: torch.device | str = "cpu",
) -> list[LayerCache]:
    """One zeroed cache per layer: [num_blocks, block_size, row] for MLA, [num_slots, ...] state for KDA."""
    caches: list[LayerCache] = []
    for spec in specs:
        if isinstance(spec, KVCacheSpec):
            kv = torch.zeros(num_blocks, block_size, spec.row_width, dtype=getattr(torch, spec.dtype), device=device)
            caches.append(MLALayerCache(kv))
        else:
            state = torch.zeros(num_slots, *spec.recurrent_shape, dtype=getattr(torch, spec.recurrent_dtype),
                                device=device)
            conv = torch.zeros(num_slots, *spec.conv_shape, dtype=getattr(torch, spec.conv_dtype), device=device)
            caches.append(KDALayerCache(state, conv))
    return caches
