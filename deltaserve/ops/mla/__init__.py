"""Paged latent attention (MLA, no positional encoding): the only entry points layers call."""

from __future__ import annotations

from deltaserve.ops.mla.ref import mla_decode, mla_prefill, mla_write_cache

__all__ = ["mla_decode", "mla_prefill", "mla_write_cache"]
