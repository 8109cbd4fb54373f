"""The CPU backend of the recurrent KDA decode against the reference: outputs and states, slices and gathered slots,
fp32 and bf16 inputs, mild and K3-steep gates, many steps in a row."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.kda import cpu_decode, kda_decode, kda_gate, native, ref

H, K = 4, 32

pytestmark = pytest.mark.usefixtures("default_dispatch")


def inputs(n: int, dtype: torch.dtype, steep: bool, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, K, generator=g).to(dtype) for _ in range(3))
    f = torch.randn(n, H, K, generator=g) * (3.0 if steep else 1.0)
    a_log = torch.randn(1, 1, H, 1, generator=g)
    gate = kda_gate(f, a_log, torch.randn(H * K, generator=g), -5.0 if steep else None)
    return q, k, v, gate, torch.rand(n, H, generator=g)


def rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steep", [False, True], ids=["mild", "k3-steep"])
@pytest.mark.parametrize("slots", ["slice", "gathered"])
def test_cpu_decode_matches_the_reference_over_many_steps(n, dtype, steep, slots):
    """20 decode steps in a row from a non-zero state: outputs and every slot within the fp32 KDA tolerance (1e-5;
    bf16 inputs are the same inputs to both, so the same bound); slots not named stay untouched."""
    g = torch.Generator().manual_seed(n)
    pool = torch.randn(2 * n + 3, H, K, K, generator=g) * 0.1
    ours, theirs = pool.clone(), pool.clone()
    index: torch.Tensor | slice = (slice(2, 2 + n) if slots == "slice"
                                   else torch.randperm(2 * n + 3, generator=g)[:n])
    for step in range(20):
        args = inputs(n, dtype, steep, seed=100 * n + step)
        out = cpu_decode.kda_decode(*args, ours, index)
        want = ref.kda_decode(*args, theirs, index)
        assert out.dtype == dtype and out.shape == want.shape
        assert rel(out, want) <= 1e-5 if dtype == torch.float32 else rel(out, want) <= 2**-7
    assert rel(ours, theirs) <= 1e-5
    named = set(range(2, 2 + n)) if slots == "slice" else set(index.tolist())
    for s in set(range(2 * n + 3)) - named:
        assert torch.equal(ours[s], pool[s])


def test_dispatch_takes_the_cpu_decode_for_fp32_and_bf16_not_fp64():
    """The C kernel where it builds (a compiler here), else the PyTorch CPU backend; fp64 to the reference."""
    fast = "native" if native.available() else "cpu"
    pool = torch.zeros(2, H, K, K)
    q, k, v, gate, beta = inputs(1, torch.float32, False, seed=0)
    assert kda_decode.select(q, k, v, gate, beta, pool, slice(0, 1)) == fast  # type: ignore[attr-defined]
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    assert kda_decode.select(qb, kb, vb, gate, beta, pool, slice(0, 1)) == fast  # type: ignore[attr-defined]
    q64, k64, v64, g64, b64 = (t.double() for t in (q, k, v, gate, beta))
    assert kda_decode.select(q64, k64, v64, g64, b64, pool.double(), slice(0, 1)) == "ref"  # type: ignore[attr-defined]
