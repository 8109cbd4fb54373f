"""Paged latent attention (MLA, no positional encoding): the only entry points layers call, dispatched. `mla_prefill`
has the CPU flash-attention backend (`sdpa.py`) for fp32 and bf16; everything else runs the reference."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.mla import ref, sdpa

mla_write_cache = dispatch.op("mla_write_cache", ref.mla_write_cache)
mla_prefill = dispatch.op("mla_prefill", ref.mla_prefill)
mla_decode = dispatch.op("mla_decode", ref.mla_decode)
dispatch.register(
    "mla_prefill",
    dispatch.Backend("sdpa", sdpa.mla_prefill_sdpa, available=sdpa.available, supports=sdpa.supports),
)

__all__ = ["mla_decode", "mla_prefill", "mla_write_cache"]
