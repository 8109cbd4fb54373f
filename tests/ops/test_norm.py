"""Parity of deltaserve.ops.norm (RMSNorm, gated RMSNorm) with transformers' Kimi Linear norms."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearRMSNormGated

from deltaserve.ops.norm import gated_rms_norm, rms_norm


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    """Fail on NaN, shape or dtype mismatch, or a max-abs error above ``rtol * max|ref|``; report both errors."""
    assert not torch.isnan(out).any(), f"{name}: output has NaN"
    assert not torch.isnan(ref).any(), f"{name}: reference has NaN"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    abs_err = (out.double() - ref.double()).abs().max().item()
    rel_err = abs_err / max(ref.double().abs().max().item(), 1e-30)
    assert rel_err <= rtol, f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} > {rtol:.1e}"


DTYPES = [
    pytest.param(torch.float32, torch.float32, id="x_fp32-w_fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="x_bf16-w_fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="x_bf16-w_bf16"),
]


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-6], ids=["eps1e-5", "eps1e-6"])
def test_rms_norm_matches_transformers(x_dtype: torch.dtype, w_dtype: torch.dtype, eps: float) -> None:
    """rms_norm casts back to the input dtype before the weight, exactly as KimiLinearRMSNorm (dtype included)."""
    g = torch.Generator().manual_seed(0)
    hidden = 40
    x = (torch.randn(7, 3, hidden, generator=g) * 3.0).to(x_dtype)
    weight = (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(w_dtype)
    module = KimiLinearRMSNorm(hidden, eps=eps).to(w_dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        ref = module(x)
    out = rms_norm(x, weight, eps)
    assert_close("rms_norm", ref, out, rtol=0.0)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_gated_rms_norm_matches_transformers(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """gated_rms_norm applies weight and sigmoid gate in fp32 and casts once, exactly as KimiLinearRMSNormGated."""
    g = torch.Generator().manual_seed(1)
    heads, head_dim, eps = 3, 24, 1e-5
    x = (torch.randn(11, heads, head_dim, generator=g) * 2.0).to(x_dtype)
    gate = (torch.randn(11, heads, head_dim, generator=g) * 2.0).to(x_dtype)
    weight = (1.0 + 0.3 * torch.randn(head_dim, generator=g)).to(w_dtype)
    module = KimiLinearRMSNormGated(head_dim, eps=eps).to(w_dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        ref = module(x, gate)
    out = gated_rms_norm(x, gate, weight, eps)
    assert_close("gated_rms_norm", ref, out, rtol=0.0)


def test_rms_norm_handles_zero_rows() -> None:
    """An all-zero row stays finite (eps keeps rsqrt bounded) and maps to zeros."""
    x = torch.zeros(2, 40)
    out = rms_norm(x, torch.ones(40), 1e-6)
    assert torch.equal(out, torch.zeros(2, 40))
