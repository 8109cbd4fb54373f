"""Causal short convolution with a conv-state pool: the only entry points layers call."""

from __future__ import annotations

from deltaserve.ops.short_conv.ref import short_conv_decode, short_conv_prefill

__all__ = ["short_conv_decode", "short_conv_prefill"]
