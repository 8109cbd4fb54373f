"""Causal short convolution with a conv-state pool: the only entry points layers call, dispatched. CPU calls in fp32 /
bf16 take the fused multiply-add backend (`cpu.py`); everything else runs the reference."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.short_conv import cpu, ref

short_conv_prefill = dispatch.op("short_conv_prefill", ref.short_conv_prefill)
short_conv_decode = dispatch.op("short_conv_decode", ref.short_conv_decode)
dispatch.register("short_conv_prefill", dispatch.Backend("cpu", cpu.short_conv_prefill, supports=cpu.supports))
dispatch.register("short_conv_decode", dispatch.Backend("cpu", cpu.short_conv_decode, supports=cpu.supports))

__all__ = ["short_conv_decode", "short_conv_prefill"]
