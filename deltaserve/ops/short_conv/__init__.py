"""Causal short convolution with a conv-state pool: the only entry points layers call, dispatched. CPU calls in fp32 /
bf16 take the fused multiply-add backend (`cpu.py`), and CPU decodes the C kernel (`native.c`) where it builds;
everything else runs the reference. `short_conv_verify`
(speculative verify chunks) follows the decode backend, so that a verified token gets the numbers plain decoding
gives it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deltaserve.ops import dispatch
from deltaserve.ops.short_conv import cpu, native, ref
from deltaserve.ops.stepwise_verify import verify_stepwise

short_conv_prefill = dispatch.op("short_conv_prefill", ref.short_conv_prefill)
short_conv_decode = dispatch.op("short_conv_decode", ref.short_conv_decode)
dispatch.register("short_conv_prefill", dispatch.Backend("cpu", cpu.short_conv_prefill, supports=cpu.supports))
dispatch.register("short_conv_decode", dispatch.Backend("native", native.short_conv_decode, available=native.available,
                                                         supports=native.supports))
dispatch.register("short_conv_decode", dispatch.Backend("cpu", cpu.short_conv_decode, supports=cpu.supports))



def short_conv_verify(x: Tensor, weight: Tensor, conv_state_pool: Tensor, state_indices: Tensor,
                      cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Speculative verify chunks: each token exactly as `short_conv_decode` would run it after the chunk's previous
    tokens (the backend it picks for these arguments), SiLU applied.

    Args:
        x: ``[R, C]`` the chunks' pre-conv rows; weight: ``[C, W]``.
        conv_state_pool: ``[num_slots, C, W-1]``; each chunk's slot ends with the window after its last token.
        state_indices: ``[S]`` int64 distinct slot of each chunk.
        cu_seqlens: ``S + 1`` host offsets of the chunks' rows, from 0.
        scratch_slots: per chunk, slots that receive its window after each of its first tokens (slot j after token j).

    Returns:
        ``[R, C]`` in x's dtype.
    """
    backend = dispatch.get("short_conv_decode").select(x, weight, conv_state_pool, state_indices)
    if backend == "native":
        return native.short_conv_verify(x, weight, conv_state_pool, state_indices, cu_seqlens, scratch_slots)
    if backend == "cpu" and torch.promote_types(x.dtype, conv_state_pool.dtype) == conv_state_pool.dtype:
        # The CPU prefill does the CPU decode's arithmetic token for token (same casts, products and fused adds,
        # oldest tap first) when the pool holds x exactly, and writes a checkpoint window after any token.
        return cpu.short_conv_prefill(x, weight, conv_state_pool, state_indices, cu_seqlens,
                                      checkpoint_positions=[range(1, len(s) + 1) for s in scratch_slots],
                                      checkpoint_slots=scratch_slots)
    return verify_stepwise(lambda rows, slots: short_conv_decode(x[rows], weight, conv_state_pool, slots),
                           x.shape[0], conv_state_pool, state_indices, cu_seqlens, scratch_slots)


__all__ = ["short_conv_decode", "short_conv_prefill", "short_conv_verify"]
