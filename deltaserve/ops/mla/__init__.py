"""Paged latent attention (MLA, no positional encoding): the only entry points layers call, dispatched. `mla_prefill`
(`sdpa.py`) and `mla_decode` (`cpu_decode.py`) have CPU flash-attention backends for fp32 and bf16; everything else
runs the reference."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.mla import cpu_decode, ref, sdpa

mla_write_cache = dispatch.op("mla_write_cache", ref.mla_write_cache)
mla_prefill = dispatch.op("mla_prefill", ref.mla_prefill)
mla_decode = dispatch.op("mla_decode", ref.mla_decode)
dispatch.register(
    "mla_prefill",
    dispatch.Backend("sdpa", sdpa.mla_prefill_sdpa, available=sdpa.available, supports=sdpa.supports),
)
dispatch.register(
    "mla_decode",
    dispatch.Backend("cpu", cpu_decode.mla_decode_cpu, available=sdpa.available, supports=cpu_decode.supports),
)

__all__ = ["mla_decode", "mla_prefill", "mla_write_cache"]
