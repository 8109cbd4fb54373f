"""Native CPU backend of the recurrent KDA ops (`native.c`, built by `deltaserve.ops.native_backend`): one kernel for
decode rows and speculative verify chunks, so that verification is exact by construction, with the state read once
and updated once per token and no per-op overhead (a decode row of the embedded model's layer: ~10 us against
~110 us for the PyTorch backend; a verify chunk of 8 tokens ~25 us against ~620 us)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deltaserve.ops import native_backend
from deltaserve.ops.native_backend import Chunks, decode_chunks, ptr, verify_chunks

SOURCE = Path(__file__).with_name("native.c")
_DTYPES = (torch.float32, torch.bfloat16)
_MAX_DIM = 1024  # MAX_DIM in native.c


def available() -> bool:
    """The kernel is built (or can be) here."""
    return _kernel() is not None


def supports(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, *args: object,
             **kwargs: object) -> bool:
    """CPU calls with fp32 / bf16 activations, an fp32 gate and a contiguous fp32 state pool, head dims up to 1024."""
    return (q.device.type == "cpu" and state_pool.dtype == torch.float32 and state_pool.is_contiguous()
            and all(t.dtype in _DTYPES for t in (q, k, v, beta)) and g.dtype == torch.float32
            and q.shape[-1] <= _MAX_DIM and v.shape[-1] <= _MAX_DIM)


def kda_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
               state_indices: Tensor | slice) -> Tensor:
    """Same contract as `deltaserve.ops.kda.ref.kda_decode`: each row a chunk of one token."""
    return _run(q, k, v, g, beta, state_pool, decode_chunks(q.shape[0], state_indices))


def kda_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
               cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Same contract as `deltaserve.ops.kda.kda_verify`."""
    return _run(q, k, v, g, beta, state_pool, verify_chunks(state_indices, cu_seqlens, scratch_slots))


def _run(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, chunks: Chunks) -> Tensor:
    kernel = _kernel()
    assert kernel is not None, "native KDA kernel used where it is not available"
    r, h, dk = q.shape
    dv = v.shape[-1]
    qf, kf, vf, gf, bf = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots, cu, scratch, scratch_cu = chunks
    out = torch.empty(r, h, dv, dtype=torch.float32)
    rc = kernel(ptr(qf), ptr(kf), ptr(vf), ptr(gf), ptr(bf), ptr(pool), pool.shape[0], ptr(slots), ptr(cu),
                ptr(scratch), ptr(scratch_cu), slots.shape[0], h, dk, dv, ptr(out), torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"kda native kernel: a state slot is outside the pool's {pool.shape[0]} slots")
    if rc != 0:
        raise ValueError(f"kda native kernel: head dims {dk}, {dv} exceed {_MAX_DIM}")
    return out.to(q.dtype)


def _kernel() -> Callable[..., int] | None:
    return native_backend.function(str(SOURCE), "kda_recurrent", [ctypes.c_void_p] * 6 + [ctypes.c_int64]
                                   + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int])
