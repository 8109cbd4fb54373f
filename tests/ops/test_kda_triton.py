"""The Triton KDA decode (`ops/kda/triton_decode.py`) against the reference, in fp32 under the Triton interpreter
(marked `interpret`; skipped without triton) and in bf16 on a GPU (marked `gpu`): 10 steps in a row (20 on a GPU)
from a non-zero state, slots as a slice or gathered in any order (updated in place, the others untouched), mild and
K3-steep gates, head sizes that are not powers of two and value widths of several column tiles."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.kda import kda_gate, ref

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (kernels extra)"),
              pytest.mark.usefixtures("default_dispatch")]
if importlib.util.find_spec("triton") is not None:
    from deltaserve.ops.kda import triton_decode


def inputs(n: int, heads: int, dk: int, dv: int, steep: bool, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g)
    f = torch.randn(n, heads, dk, generator=g) * (3.0 if steep else 1.0)
    gate = kda_gate(f, torch.randn(1, 1, heads, 1, generator=g), torch.randn(heads * dk, generator=g),
                    -5.0 if steep else None)
    beta = torch.rand(n, heads, generator=g)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), gate.to(device), beta.to(device))


def rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double().cpu() - want.double().cpu()).abs().max() / want.double().abs().max()).item()


CASES = [  # (rows, heads, K, V, slots)
    (1, 4, 32, 32, "slice"),
    (5, 4, 32, 32, "gathered"),
    (3, 2, 48, 72, "gathered"),  # K not a power of two; V: three column tiles, the last partial
]


@pytest.mark.interpret
@pytest.mark.parametrize(("n", "heads", "dk", "dv", "slots"), CASES)
@pytest.mark.parametrize("steep", [False, True], ids=["mild", "k3-steep"])
def test_interpreted_kernel_equals_the_reference_over_many_steps(triton_interpreter, n, heads, dk, dv, slots, steep):
    g = torch.Generator().manual_seed(n + dk)
    size = 2 * n + 3
    pool = torch.randn(size, heads, dk, dv, generator=g) * 0.1
    ours, theirs = pool.clone(), pool.clone()
    index: torch.Tensor | slice = slice(2, 2 + n) if slots == "slice" else torch.randperm(size, generator=g)[:n]
    for step in range(10):
        args = inputs(n, heads, dk, dv, steep, seed=100 * n + step)
        out = triton_decode.kda_decode_triton(*args, ours, index)
        want = ref.kda_decode(*args, theirs, index)
        assert out.dtype == torch.float32 and out.shape == want.shape == (n, heads, dv)
        assert rel(out, want) <= 1e-5
    assert rel(ours, theirs) <= 1e-5
    named = set(range(2, 2 + n)) if slots == "slice" else set(index.tolist())
    for s in set(range(size)) - named:
        assert torch.equal(ours[s], pool[s])


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "heads", "dk", "dv", "slots"), CASES)
def test_cuda_kernel_equals_the_reference(n, heads, dk, dv, slots):
    """bf16 activations (the fp32 reference on the same bf16 inputs; the output rounded to bf16) and fp32."""
    for dtype, tol in ((torch.bfloat16, 2**-7), (torch.float32, 1e-5)):
        pool = torch.randn(2 * n + 3, heads, dk, dv, generator=torch.Generator().manual_seed(n)) * 0.1
        ours, theirs = pool.cuda(), pool.clone()
        index = slice(2, 2 + n) if slots == "slice" else torch.arange(2 * n + 2, n + 2, -1)[:n]
        for step in range(20):
            args = inputs(n, heads, dk, dv, True, seed=step, dtype=dtype, device="cuda")
            out = triton_decode.kda_decode_triton(*args, ours, index if isinstance(index, slice) else index.cuda())
            want = ref.kda_decode(*(t.cpu() for t in args), theirs, index)
            assert out.dtype == dtype and rel(out, want) <= tol
        assert rel(ours, theirs) <= 1e-5
