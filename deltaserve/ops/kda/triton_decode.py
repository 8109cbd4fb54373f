"""KDA recurrent decode in Triton: the `triton` backend of `kda_decode` (same contract as `ref.kda_decode`) for CUDA
tensors, with the state pool read and written in place through the rows' slot indices (vLLM's `ssm_state_indices`).

One program updates one (row, head, tile of value columns): it loads that tile of the slot's ``[K, V]`` state
(fp32), L2-normalises q and k over the head dim, and does the whole step in registers: decay ``S *= exp(g)`` per key
row, delta rule ``S += k (beta (v - k^T S))^T``, read ``o = q^T S``; then writes the tile back. The tiles of one
head are independent (every operation is per value column), so nothing is shared between programs. Speculative
verification calls this once per token position with the scratch slots as indices.

Tested in fp32 under the Triton interpreter against the reference (`tests/ops/test_kda_triton.py`, marked
`interpret`), and in bf16 on a GPU (marked `gpu`). Imports triton: registered with dispatch by name.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 32
"""Value columns per program: a 128 x 32 fp32 tile of the state (16 KiB) and the heads x tiles grid fill the GPU at
batch 1 (K3: 32 heads x 4 tiles)."""


def kda_decode_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                      state_indices: Tensor | slice) -> Tensor:
    """`ref.kda_decode`'s contract: one token per row, the rows' state slots updated in place; ``[N, H, V]`` out in
    ``q.dtype``."""
    num_rows, num_heads, dk = q.shape
    dv = v.shape[-1]
    if isinstance(state_indices, slice):
        start = state_indices.start or 0
        slots = torch.arange(start, start + num_rows, device=q.device, dtype=torch.int64)
    else:
        slots = state_indices.to(device=q.device, dtype=torch.int64)
    if num_rows == 0:
        return q.new_empty(0, num_heads, dv)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    beta = beta.contiguous()
    out = torch.empty(num_rows, num_heads, dv, dtype=q.dtype, device=q.device)
    pool = state_pool
    grid = (num_rows, num_heads, triton.cdiv(dv, BLOCK_V))
    _kda_decode_step[grid](
        q, k, v, g, beta, pool, slots, out,
        pool.stride(0), pool.stride(1), pool.stride(2),
        num_heads, dk, dv, float(dk ** -0.5),
        BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=BLOCK_V,
    )
    return out


@triton.jit
def _kda_decode_step(
    Q, K, V, G, BETA, S, SLOTS, O,
    stride_ss, stride_sh, stride_sk,
    num_heads, dk, dv, q_scale,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, BLOCK_K)
    kmask, vmask = keys < dk, cols < dv
    qk_off = (row * num_heads + head) * dk + keys
    q = tl.load(Q + qk_off, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(K + qk_off, mask=kmask, other=0.0).to(tl.float32)
    g = tl.load(G + qk_off, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + (row * num_heads + head) * dv + cols, mask=vmask, other=0.0).to(tl.float32)
    beta = tl.load(BETA + row * num_heads + head).to(tl.float32)
    # L2 norms over the head dim, eps inside the square root (spec 3.2); q also scaled by K ** -0.5.
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    slot = tl.load(SLOTS + row)
    s_ptr = S + slot * stride_ss + head * stride_sh + keys[:, None] * stride_sk + cols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(s_ptr, mask=smask, other=0.0)  # [K, BV] fp32
    state = state * tl.exp(g)[:, None]
    delta = beta * (v - tl.sum(k[:, None] * state, 0))  # [BV]
    state = state + k[:, None] * delta[None, :]
    tl.store(s_ptr, state, mask=smask)
    o = tl.sum(q[:, None] * state, 0)
    tl.store(O + (row * num_heads + head) * dv + cols, o.to(O.dtype.element_ty), mask=vmask)
