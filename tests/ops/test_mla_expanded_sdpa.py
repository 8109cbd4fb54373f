"""Parity of the `expanded_sdpa` backend of mla_prefill (deltaserve.ops.mla.expanded_sdpa: one
`F.scaled_dot_product_attention` call per sequence on expanded keys, the GPU prefill path) with the reference. On a CPU
the same function runs PyTorch's math or CPU kernels in fp32; the GPU test compares bf16 on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.mla import expanded_sdpa, ref
from tests.ops.test_mla import HEADS, SCALE, V_DIM, assert_close
from tests.ops.test_mla_sdpa import BLOCK_SIZES, FIRST, LENGTHS, chunk_problem


def run(args: tuple[torch.Tensor, ...], host: bool = True) -> torch.Tensor:
    q, _, _, cu, ctx, *_ = args
    kwargs = {"cu_seqlens_host": cu.tolist(), "context_lens_host": ctx.tolist()} if host else {}
    return expanded_sdpa.mla_prefill_expanded(*args, scale=SCALE, **kwargs)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_expanded_sdpa_equals_reference_fp32(block_size: int) -> None:
    """Whole prompts, chunks after cached prefixes on and off block boundaries, single queries with and without
    context, a sequence with no queries, in a shuffled NaN-filled paged cache: the reference and dense fp64 attention
    within the README's fp32 tolerance; the same without host lengths (read from the tensors)."""
    args, dense = chunk_problem(LENGTHS, FIRST, block_size, torch.float32, seed=31)
    out = run(args)
    assert out.dtype == torch.float32 and out.shape == (args[0].shape[0], HEADS, V_DIM)
    assert_close("expanded_vs_ref", ref.mla_prefill(*args, scale=SCALE), out, 1e-5)
    assert_close("expanded_vs_dense", dense, out, 1e-5)
    assert torch.equal(run(args, host=False), out)


def test_expanded_sdpa_is_dispatched_on_cuda_only() -> None:
    """`supports`: CUDA tensors with host lengths, within the expansion budget; never a CPU call (the CPU flash
    backend serves those) nor one without host lengths (the reference, which may read the device)."""
    args, _ = chunk_problem([5, 9], [0, 4], 4, torch.float32, seed=1)
    assert not expanded_sdpa.supports(*args, scale=SCALE, cu_seqlens_host=[0, 5, 10], context_lens_host=[5, 9])
    assert not expanded_sdpa.supports(*args, scale=SCALE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_sdpa_on_cuda(dtype: torch.dtype) -> None:
    """On a GPU (fused kernels): within fp32 / bf16 rounding of the reference, chosen by dispatch, no host read."""
    from deltaserve.ops.mla import mla_prefill

    args, dense = chunk_problem(LENGTHS, FIRST, 16, dtype, seed=32)
    host = {"cu_seqlens_host": args[3].tolist(), "context_lens_host": args[4].tolist()}
    args = tuple(a.cuda() for a in args)
    assert expanded_sdpa.supports(*args, scale=SCALE, **host)
    out = mla_prefill(*args, scale=SCALE, **host)
    expected = ref.mla_prefill(*args, scale=SCALE)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert_close("expanded_cuda_vs_ref", expected.double().cpu(), out.double().cpu(), tol)
    assert_close("expanded_cuda_vs_dense", dense, out.double().cpu(), tol)
