"""Paged latent attention (MLA, no positional encoding): the only entry points layers call, dispatched (today only
the reference)."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.mla import ref

mla_write_cache = dispatch.op("mla_write_cache", ref.mla_write_cache)
mla_prefill = dispatch.op("mla_prefill", ref.mla_prefill)
mla_decode = dispatch.op("mla_decode", ref.mla_decode)

__all__ = ["mla_decode", "mla_prefill", "mla_write_cache"]
