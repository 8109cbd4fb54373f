"""K3's SiTU activation (model-spec §6) against its formula, and the MoE op's K3 options (late fp32 combine)."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops.activation import situ, situ_and_mul
from deltaserve.ops.moe import moe_experts


def test_situ_matches_formula_and_bound() -> None:
    """SiTU(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2), |SiTU| <= b1 * b2; sigmoid sees the uncapped g."""
    g = torch.linspace(-60, 60, 241, dtype=torch.float64)
    u = torch.linspace(-300, 300, 241, dtype=torch.float64).flip(0)
    out = situ(g, u, 4.0, 25.0)
    ref = [4 * math.tanh(a / 4) / (1 + math.exp(-a)) * 25 * math.tanh(b / 25)
           for a, b in zip(g.tolist(), u.tolist(), strict=True)]
    assert torch.allclose(out, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert out.abs().max() <= 100.0
    assert torch.equal(situ(g, u, 4.0, None), 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_situ_and_mul_halves_and_interleaved(dtype: torch.dtype) -> None:
    """Halves (gate | up) and interleaved (gate0, up0, gate1, ...) layouts give the same result; math in fp32."""
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(5, 6, generator=gen) * 10).to(dtype), (torch.randn(5, 6, generator=gen) * 40).to(dtype)
    halves = situ_and_mul(torch.cat((gate, up), -1), 4.0, 25.0)
    inter = situ_and_mul(torch.stack((gate, up), -1).flatten(-2), 4.0, 25.0, interleaved=True)
    assert halves.dtype == dtype and torch.equal(halves, inter)
    assert torch.equal(halves, situ(gate.float(), up.float(), 4.0, 25.0).to(dtype))


def test_moe_experts_late_weights_fp32_combine() -> None:
    """fp32_combine: each bf16 expert output is rounded to bf16, weighted in fp32 and summed in fp32, then cast once
    (NeMo's reference order); a custom activation is applied per expert."""
    gen = torch.Generator().manual_seed(1)
    T, d, i, e, k = 6, 32, 16, 4, 2
    x = torch.randn(T, d, generator=gen).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, generator=gen) / 4).bfloat16()
    w2 = (torch.randn(e, d, i, generator=gen) / 4).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    act = lambda h: situ_and_mul(h, 4.0, 25.0, interleaved=True)  # noqa: E731
    out = moe_experts(x, w13, w2, weights, ids, act=act, fp32_combine=True)
    ref = torch.zeros(T, d)
    for t in range(T):
        for j in range(k):
            ex = ids[t, j]
            y = torch.nn.functional.linear(act(torch.nn.functional.linear(x[t : t + 1], w13[ex])), w2[ex])  # bf16
            ref[t] += weights[t, j] * y[0].float()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16())
