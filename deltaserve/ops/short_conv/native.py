"""Native CPU backend of the short convolution's decode and speculative-verify ops (`native.c`, built by
`deltaserve.ops.native_backend`): one kernel for both, so that verification is exact by construction, with no per-op
overhead (a decode row of the embedded model's layer: ~10 us against ~70 us for the PyTorch backend)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deltaserve.ops import native_backend
from deltaserve.ops.native_backend import Chunks, decode_chunks, ptr, verify_chunks
from deltaserve.ops.short_conv import ref

SOURCE = Path(__file__).with_name("native.c")
_DTYPES = (torch.float32, torch.bfloat16)
_MAX_WIDTH = 16  # MAX_WIDTH in native.c


def available() -> bool:
    """The kernel is built (or can be) here."""
    return _kernel() is not None


def supports(x: Tensor, weight: Tensor, conv_state_pool: Tensor, *args: object, **kwargs: object) -> bool:
    """CPU calls with fp32 / bf16 inputs, weight and contiguous pool, where the inputs are exact in the weight's and
    the pool's dtypes (a bf16 model; an fp32 one; K3's bf16 inputs with fp32 weights and pool)."""
    return (x.device.type == "cpu" and all(t.dtype in _DTYPES for t in (x, weight, conv_state_pool))
            and conv_state_pool.is_contiguous() and 1 <= weight.shape[-1] <= _MAX_WIDTH
            and torch.promote_types(x.dtype, weight.dtype) == weight.dtype
            and torch.promote_types(x.dtype, conv_state_pool.dtype) == conv_state_pool.dtype)


def short_conv_decode(x: Tensor, weight: Tensor, conv_state_pool: Tensor, state_indices: Tensor | slice,
                      activation: str | None = "silu") -> Tensor:
    """Same contract as `deltaserve.ops.short_conv.ref.short_conv_decode`: each row a chunk of one token."""
    return _run(x, weight, conv_state_pool, decode_chunks(x.shape[0], state_indices), activation)


def short_conv_verify(x: Tensor, weight: Tensor, conv_state_pool: Tensor, state_indices: Tensor,
                      cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Same contract as `deltaserve.ops.short_conv.short_conv_verify`."""
    return _run(x, weight, conv_state_pool, verify_chunks(state_indices, cu_seqlens, scratch_slots), "silu")


def _run(x: Tensor, weight: Tensor, pool: Tensor, chunks: Chunks, activation: str | None) -> Tensor:
    kernel = _kernel()
    assert kernel is not None, "native short-conv kernel used where it is not available"
    ref._activate(x[:0], activation)  # an unknown name is refused before the pool is touched
    r, c = x.shape
    width = weight.shape[-1]
    xf, wf = x.float().contiguous(), weight.float().t().contiguous()
    slots, cu, scratch, scratch_cu = chunks
    out = torch.empty(r, c, dtype=torch.float32)
    rc = kernel(ptr(xf), ptr(wf), ptr(pool), int(pool.dtype == torch.bfloat16), pool.shape[0], ptr(slots), ptr(cu),
                ptr(scratch), ptr(scratch_cu), slots.shape[0], c, width, ptr(out), int(weight.dtype == torch.bfloat16),
                int(activation is not None))
    if rc == -2:
        raise IndexError(f"short-conv native kernel: a state slot is outside the pool's {pool.shape[0]} slots")
    if rc != 0:
        raise ValueError(f"short-conv native kernel: width {width} exceeds {_MAX_WIDTH}")
    return out.to(x.dtype)  # the kernel rounded to the weight's dtype as the reference does; exact from there


def _kernel() -> Callable[..., int] | None:
    return native_backend.function(str(SOURCE), "short_conv_step", [ctypes.c_void_p] * 3
                                   + [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
                                   + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
