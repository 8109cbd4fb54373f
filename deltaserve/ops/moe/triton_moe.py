"""Fused MoE in Triton: the `triton` backend of `moe_experts` (same contract as `ref.moe_experts`) for CUDA tensors,
dense or MXFP4 expert stacks, SiLU-GLU or K3's SiTU, gate/up rows split or interleaved, fp32 combine or not.

1. Alignment (torch, on the device, no host sync): the (token, slot) pairs are sorted by expert and each expert's
   run is padded to a multiple of `BLOCK_M`, so that every block of `BLOCK_M` sorted rows belongs to one expert
   (vLLM's `moe_align_block_size`). The sizes come from the shapes: at most ``T*k + E*(BLOCK_M - 1)`` rows; blocks
   past the real ones, and pairs of another expert-parallel rank's expert (id -1), do no work.
2. `_moe_up`: per block and tile of intermediate columns, the gate and up GEMMs over the tokens' rows (gathered by
   pair, never copied), the activation applied in registers, ``h`` written in the activation dtype.
3. `_moe_down`: per block and tile of output columns, ``h W2^T`` times the pair's routing weight, written to the
   pair's own row of an fp32 buffer; the k rows of a token are summed after (in fp32 with ``fp32_combine``, else
   each rounded to the activation dtype first, as the reference's accumulation).

MXFP4 weights are decoded inside both GEMMs, a tile at a time (E2M1 nibbles, low nibble = even column, times the
E8M0 scale of each 32 columns): no dequantised copy of an expert exists. Tested in fp32 under the Triton interpreter
against the reference (`tests/ops/test_moe_triton.py`, marked `interpret`) and on a GPU (marked `gpu`). Block sizes
are fixed, not tuned (no GPU has been lent to tune them). Imports triton: registered with dispatch by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe.fused_spec import fused_act, weight_format
from deltaserve.ops.mxfp4.ref import MXFP4Tensor

BLOCK_M = 16
"""Sorted rows per block (one expert each)."""
BLOCK_N = 32
"""Output columns per program."""
BLOCK_K = 32
"""Inner-dimension step: one E8M0 scale per row of an MXFP4 tile."""


def moe_experts_triton(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor, topk_ids: Tensor, *,
                       act: Callable[[Tensor], Tensor] = silu_and_mul,
                       linear: Callable[[Tensor, Any], Tensor] = F.linear, fp32_combine: bool = False) -> Tensor:
    """`ref.moe_experts`'s contract for the calls `supports` accepts: x ``[T, d]`` -> ``[T, d]``."""
    spec, fmt = fused_act(act), weight_format(linear)
    if spec is None or fmt is None:
        raise ValueError("moe_experts_triton: an activation or weight format the kernel does not know")
    num_tokens, d = x.shape
    top_k = topk_ids.shape[1]
    num_experts = len(w13)
    inter = w13.shape[1] // 2
    if num_tokens == 0:
        return x.new_zeros(0, d)
    pairs, block_expert = _align(topk_ids, num_experts)
    num_pairs, num_blocks = num_tokens * top_k, block_expert.shape[0]
    x = x.contiguous()
    h = torch.empty(pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    w13_t, s13, w2_t, s2 = _stacks(w13, w2, fmt)
    gate0, up0, step = (0, 1, 2) if spec.interleaved else (0, inter, 1)
    ieee = x.dtype == torch.float32
    _moe_up[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13_t, s13, h, pairs, block_expert, num_pairs, top_k, d, inter,
        x.stride(0), w13_t.stride(0), w13_t.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        gate0, up0, step, spec.beta, spec.linear_beta or 0.0,
        SITU=spec.situ, LINEAR_BETA=spec.linear_beta is not None, MXFP4=fmt == "mxfp4",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
    )
    out = torch.zeros(num_pairs, d, dtype=torch.float32, device=x.device)  # skipped pairs stay 0
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _moe_down[(num_blocks, triton.cdiv(d, BLOCK_N))](
        h, w2_t, s2, out, pairs, block_expert, weights, num_pairs, inter, d,
        h.stride(0), w2_t.stride(0), w2_t.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        ROUND_TO_X=True, MXFP4=fmt == "mxfp4", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
    )
    per_slot = out.view(num_tokens, top_k, d)
    if fp32_combine:
        return per_slot.sum(dim=1).to(x.dtype)
    return per_slot.to(x.dtype).sum(dim=1)


def _stacks(w13: Any, w2: Any, fmt: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(w13 values, w13 scales, w2 values, w2 scales): dense stacks with a 1-element dummy for the scales, or an
    MXFP4 stack's packed bytes and scale bytes."""
    if fmt == "mxfp4":
        assert isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor)
        return w13.packed, w13.scale, w2.packed, w2.scale
    dummy = torch.zeros(1, 1, dtype=torch.uint8, device=w13.device)
    return w13, dummy, w2, dummy


def _align(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(pairs, block_expert): `pairs[r]` is the (token * k + slot) of sorted row r, or `T*k` for a padding row;
    `block_expert[b]` the expert of rows ``[b*BLOCK_M, (b+1)*BLOCK_M)``, or -1 for a block past the real ones."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.long)
    num_pairs = ids.shape[0]
    group = torch.where(ids >= 0, ids, num_experts)  # id -1 (another rank's expert): a group no block runs
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, group, torch.ones_like(group))
    padded = (counts[:num_experts] + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_group]
    bound = -(-(num_pairs + num_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    real = sorted_group < num_experts
    start = (padded_end - padded)[sorted_group.clamp(max=num_experts - 1)]
    dest = torch.where(real, start + rank, bound)  # skipped pairs land in a dump row past the end
    pairs = torch.full((bound + 1,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, bound, BLOCK_M, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    if not topk_ids.is_cuda:  # the interpreter (tests): a host read is free here and saves it the empty blocks
        block_expert = block_expert[: max(1, int(padded_end[-1]) // BLOCK_M)]
    return pairs[:bound], block_expert


@triton.jit
def _e2m1(nibble):
    """E2M1 codes (0-15) -> their values: magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 by the low 3 bits, sign by bit 3."""
    mag = (nibble & 7).to(tl.int32)  # not uint8: exponent - 1 must not wrap
    exponent = mag >> 1
    mantissa = (mag & 1).to(tl.float32)
    value = tl.where(exponent == 0, 0.5 * mantissa, tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * mantissa))
    return tl.where((nibble & 8) != 0, -value, value)


@triton.jit
def _weight_tile(W, S, expert, rows, row_mask, k0, stride_we, stride_wr, stride_se, stride_sr, width,
                 MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `rows` x columns ``[k0, k0 + BLOCK_K)`` of expert `expert`'s matrix, in fp32 (MXFP4 decoded here)."""
    if MXFP4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(W + expert * stride_we + rows[:, None] * stride_wr + half[None, :],
                         mask=row_mask[:, None] & (half[None, :] < width // 2), other=0)
        values = tl.reshape(tl.join(_e2m1(packed & 15), _e2m1(packed >> 4)), [BLOCK_N, BLOCK_K])
        scale = tl.load(S + expert * stride_se + rows * stride_sr + k0 // BLOCK_K, mask=row_mask, other=127)
        return values * tl.exp2(scale.to(tl.float32) - 127.0)[:, None]
    cols = k0 + tl.arange(0, BLOCK_K)
    tile = tl.load(W + expert * stride_we + rows[:, None] * stride_wr + cols[None, :],
                   mask=row_mask[:, None] & (cols[None, :] < width), other=0.0)
    return tile.to(tl.float32)


@triton.jit
def _block_rows(BLOCK_EXPERT, PAIRS, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block: (its expert, -1 past the real blocks; its sorted rows; their pairs; which rows hold a
    pair of that expert)."""
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(PAIRS + rows)
    return expert, rows, pair, (pair < num_pairs) & (expert >= 0)


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter and every backend have exp): 1 - 2 / (e^{2x} + 1), exact at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _moe_up(
    X, W, S, H, PAIRS, BLOCK_EXPERT, num_pairs, top_k, d, inter,
    stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_hr,
    gate0, up0, row_step, beta, linear_beta,
    SITU: tl.constexpr, LINEAR_BETA: tl.constexpr, MXFP4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    expert, rows, pair, valid = _block_rows(BLOCK_EXPERT, PAIRS, num_pairs, BLOCK_M)
    token = tl.where(valid, pair // top_k, 0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    jmask = j < inter
    e = tl.maximum(expert, 0)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(expert >= 0, d, 0)  # a block past the real ones does no work
    for k0 in range(0, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + token[:, None] * stride_xt + cols[None, :], mask=valid[:, None] & (cols[None, :] < d),
                    other=0.0).to(tl.float32)
        wg = _weight_tile(W, S, e, gate0 + j * row_step, jmask, k0, stride_we, stride_wr, stride_se, stride_sr, d,
                          MXFP4, BLOCK_N, BLOCK_K)
        wu = _weight_tile(W, S, e, up0 + j * row_step, jmask, k0, stride_we, stride_wr, stride_se, stride_sr, d,
                          MXFP4, BLOCK_N, BLOCK_K)
        if IEEE:
            acc_gate += tl.dot(x, tl.trans(wg), input_precision="ieee")
            acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            acc_gate += tl.dot(x.to(tl.bfloat16), tl.trans(wg.to(tl.bfloat16)))
            acc_up += tl.dot(x.to(tl.bfloat16), tl.trans(wu.to(tl.bfloat16)))
    # The reference's projection comes out in the activation dtype: round there, then activate in fp32.
    g = acc_gate.to(H.dtype.element_ty).to(tl.float32)
    u = acc_up.to(H.dtype.element_ty).to(tl.float32)
    if SITU:
        if LINEAR_BETA:
            u = linear_beta * _tanh(u / linear_beta)
        out = beta * _tanh(g / beta) * tl.sigmoid(g) * u
    else:
        out = g * tl.sigmoid(g) * u
    tl.store(H + rows[:, None] * stride_hr + j[None, :], out.to(H.dtype.element_ty),
             mask=valid[:, None] & jmask[None, :])


@triton.jit
def _moe_down(
    H, W, S, OUT, PAIRS, BLOCK_EXPERT, WEIGHTS, num_pairs, inter, d,
    stride_hr, stride_we, stride_wr, stride_se, stride_sr, stride_or,
    ROUND_TO_X: tl.constexpr, MXFP4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    expert, rows, pair, valid = _block_rows(BLOCK_EXPERT, PAIRS, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < d
    e = tl.maximum(expert, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(expert >= 0, inter, 0)
    for k0 in range(0, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(H + rows[:, None] * stride_hr + cols[None, :], mask=valid[:, None] & (cols[None, :] < inter),
                    other=0.0).to(tl.float32)
        w = _weight_tile(W, S, e, n, nmask, k0, stride_we, stride_wr, stride_se, stride_sr, inter,
                         MXFP4, BLOCK_N, BLOCK_K)
        if IEEE:
            acc += tl.dot(h, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    if ROUND_TO_X:  # the reference's down projection comes out in the activation dtype
        acc = acc.to(H.dtype.element_ty).to(tl.float32)
    weight = tl.load(WEIGHTS + tl.where(valid, pair, 0), mask=valid, other=0.0)
    tl.store(OUT + tl.where(valid, pair, 0)[:, None] * stride_or + n[None, :], acc * weight[:, None],
             mask=valid[:, None] & nmask[None, :])
