"""The Triton latent MLA decode (`ops/mla/triton_decode.py`) against the reference, in fp32 under the Triton
interpreter (marked `interpret`; skipped without triton), and in bf16 on a GPU (marked `gpu`): rows of several
sequences and several rows of one sequence (a speculative verify chunk: each its own context length), head counts
that do not fill a head tile, contexts across several splits, block tables in any order, and cache rows past every
context holding NaN (they must not leak through a zero probability)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.mla import ref
from tests.helpers import relative_error

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the kernels extra)")
if importlib.util.find_spec("triton") is not None:
    from deltaserve.ops.mla import triton_decode


def case(*, heads: int, rank: int, rope: int, block_size: int, contexts: list[int], dtype=torch.float32,
         device: str = "cpu", seed: int = 0):
    """Queries, a cache with NaN in every row no context reaches, block tables of shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(contexts) // block_size)
    num_blocks = len(contexts) * max_blocks + 3
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"))
    tables = torch.randperm(num_blocks, generator=g)[: len(contexts) * max_blocks].view(len(contexts), max_blocks)
    for i, n in enumerate(contexts):
        for t in range(n):
            cache[tables[i, t // block_size], t % block_size] = torch.randn(rank + rope, generator=g)
    q = torch.randn(len(contexts), heads, rank + rope, generator=g)
    to = dict(device=device, dtype=dtype)
    return q.to(**to), cache.to(**to), tables.to(device), torch.tensor(contexts, device=device)


SHAPES = [  # (heads, rank, rope, block_size, contexts)
    (4, 64, 16, 16, [1, 37, 300]),  # the tiny checkpoints' latent; 300 tokens: two splits
    (20, 32, 16, 8, [600, 17, 5, 256]),  # two head tiles (the second partial), 600: three splits, 256: exactly one
    (2, 48, 8, 16, [40, 41, 42, 43]),  # rank and rope not powers of two; one sequence's verify rows
]


@pytest.mark.interpret
@pytest.mark.parametrize(("heads", "rank", "rope", "block_size", "contexts"), SHAPES)
def test_interpreted_kernel_equals_the_reference_fp32(triton_interpreter, heads, rank, rope, block_size, contexts):
    verify = contexts == [40, 41, 42, 43]  # one sequence's rows: a verify chunk, each row one more token
    q, cache, tables, ctx = case(heads=heads, rank=rank, rope=rope, block_size=block_size,
                                 contexts=[max(contexts)] if verify else contexts)
    if verify:
        q = torch.randn(4, heads, rank + rope, generator=torch.Generator().manual_seed(1))
        tables, ctx = tables.expand(4, -1), torch.tensor(contexts)
    scale = (rank + rope) ** -0.5
    got = triton_decode.mla_decode_triton(q, cache, tables, ctx, kv_lora_rank=rank, scale=scale)
    want = ref.mla_decode(q, cache, tables, ctx, kv_lora_rank=rank, scale=scale)
    assert got.shape == want.shape == (len(contexts), heads, rank) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert relative_error(got, want) < 1e-5


@pytest.mark.interpret
def test_no_rows_is_an_empty_output(triton_interpreter):
    q = torch.zeros(0, 4, 80)
    cache = torch.zeros(2, 16, 80)
    out = triton_decode.mla_decode_triton(q, cache, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0),
                                          kv_lora_rank=64, scale=0.1)
    assert out.shape == (0, 4, 64)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "rank", "rope", "block_size", "contexts"), SHAPES[:2])
def test_cuda_kernel_equals_the_reference(heads, rank, rope, block_size, contexts):
    """bf16 against the fp64 reference on the same bf16 inputs (the cpu backend's bound), and fp32 (IEEE dots)."""
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        q, cache, tables, ctx = case(heads=heads, rank=rank, rope=rope, block_size=block_size, contexts=contexts,
                                     dtype=dtype, device="cuda")
        scale = (rank + rope) ** -0.5
        got = triton_decode.mla_decode_triton(q, cache, tables, ctx, kv_lora_rank=rank, scale=scale)
        want = ref.mla_decode(q.double().cpu(), cache.double().cpu(), tables.cpu(), ctx.cpu(), kv_lora_rank=rank,
                              scale=scale)
        assert got.dtype == dtype and relative_error(got.double().cpu(), want) < tol

