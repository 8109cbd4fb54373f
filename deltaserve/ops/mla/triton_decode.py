"""Latent MLA decode in Triton: the `triton` backend of `mla_decode` (same contract as `ref.mla_decode`) for CUDA
tensors, split-KV over long contexts (flash-decoding).

One program attends one query row (a decode token, or one position of a speculative verify chunk: each has its own
row, block table and context length) for a tile of heads over one split of its context. The heads share the latent
rows (MQA), so a tile of heads is the M side of the two matmuls: scores ``[heads, tokens] = q_c c^T + q_r kr^T`` and
``acc += p c``, with an online softmax in fp32. Cache rows are found through the block table a tile of tokens at a
time (any block size). Each split writes its normalised partial output and logsumexp; the splits are merged in torch
(a split past a context writes -inf and weighs nothing). The grid depends only on tensor shapes (the block table's
width bounds the context), never on a device value: no host sync, so a CUDA graph can capture it.

Tested in fp32 under the Triton interpreter against the reference (`tests/ops/test_mla_triton.py`, marked
`interpret`), and in bf16 on a GPU (marked `gpu`). Imports triton: registered with dispatch by name, so that it is
imported only where the backend is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_H = 16
"""Heads per program (the M side of the matmuls; tl.dot wants at least 16)."""
BLOCK_N = 16
"""Context tokens per inner step."""
SPLIT_TOKENS = 256
"""Context tokens per split: a 32K context is 128 programs per (row, head tile)."""


def mla_decode_triton(q: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, *,
                      kv_lora_rank: int, scale: float) -> Tensor:
    """`ref.mla_decode`'s contract: ``[N, Hm, R+Dr]`` latent queries -> ``[N, Hm, R]`` in ``q.dtype``."""
    num_rows, num_heads, width = q.shape
    rank, rope = kv_lora_rank, width - kv_lora_rank
    if num_rows == 0:
        return q.new_zeros(0, num_heads, rank)
    block_size = kv_cache.shape[1]
    num_splits = max(1, -(-block_tables.shape[1] * block_size // SPLIT_TOKENS))
    q = q.contiguous()
    kv = kv_cache if kv_cache.stride(-1) == 1 else kv_cache.contiguous()
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    ctx = context_lens.to(device=q.device, dtype=torch.int32)
    out = torch.empty(num_rows, num_splits, num_heads, rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_rows, num_splits, num_heads, dtype=torch.float32, device=q.device)
    grid = (num_rows, -(-num_heads // BLOCK_H), num_splits)
    _mla_decode_split[grid](
        q, kv, tables, ctx, out, lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        num_heads, block_size, float(scale),
        RANK=rank, ROPE=rope, BLOCK_R=_pow2(rank), BLOCK_DR=_pow2(rope), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        SPLIT=SPLIT_TOKENS, IEEE=q.dtype == torch.float32,
    )
    if num_splits == 1:
        return out[:, 0].to(q.dtype)
    weights = torch.softmax(lse, dim=1)  # [N, S, H]: an empty split's -inf weighs 0 (split 0 is never empty)
    return (weights.unsqueeze(-1) * out).sum(dim=1).to(q.dtype)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@triton.jit
def _mla_decode_split(
    Q, KV, BT, CTX, O, LSE,
    stride_qn, stride_qh, stride_kvb, stride_kvt, stride_btn,
    stride_on, stride_os, stride_oh, stride_ln, stride_ls,
    num_heads, block_size, scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    ctx = tl.load(CTX + row)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, ctx)
    hmask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    dr = tl.arange(0, BLOCK_DR)
    rmask, drmask = r < RANK, dr < ROPE
    q_base = Q + row * stride_qn + heads[:, None] * stride_qh
    q_c = tl.load(q_base + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_r = tl.load(q_base + RANK + dr[None, :], mask=hmask[:, None] & drmask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        block = tl.load(BT + row * stride_btn + t // block_size, mask=tmask, other=0).to(tl.int64)
        rows = KV + block * stride_kvb + (t % block_size) * stride_kvt
        # Rows past the context may hold anything (NaN included): masked loads read them as 0.
        c = tl.load(rows[:, None] + r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        kr = tl.load(rows[:, None] + RANK + dr[None, :], mask=tmask[:, None] & drmask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(kr))
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new
    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    o_ptr = O + row * stride_on + split * stride_os + heads[:, None] * stride_oh + r[None, :]
    tl.store(o_ptr, o, mask=hmask[:, None] & rmask[None, :])
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(LSE + row * stride_ln + split * stride_ls + heads, lse, mask=hmask)

