"""Causal short convolution with a conv-state pool: the only entry points layers call, dispatched (today only the
reference)."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.short_conv import ref

short_conv_prefill = dispatch.op("short_conv_prefill", ref.short_conv_prefill)
short_conv_decode = dispatch.op("short_conv_decode", ref.short_conv_decode)

__all__ = ["short_conv_decode", "short_conv_prefill"]
