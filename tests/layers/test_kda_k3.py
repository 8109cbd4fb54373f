"""The KDA layer in its K3 configuration (model-spec §3.3, §3.6, §9.2): bounded sigmoid decay gate, full-rank output
gate, A_log zero-padded to 128, fp32 conv weights. Chunked prefill equals the token recurrence."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.config import KDAConfig
from deltaserve.layers.forward_batch import ForwardBatch, KDALayerCache
from deltaserve.layers.kda import KDAttention
from deltaserve.ops.kda import kda_gate

CFG = KDAConfig(num_heads=3, head_dim=16, conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True)
D = 40


def k3_kda(dtype: torch.dtype, fp32_params: bool, seed: int = 0) -> KDAttention:
    gen = torch.Generator().manual_seed(seed)
    layer = KDAttention(CFG, D, 1e-5, 0, dtype, a_log_size=128, k3_precision=fp32_params)
    with torch.no_grad():
        for name, t in layer.checkpoint_tensors().items():
            if name == "A_log":
                t.zero_()[: CFG.num_heads] = torch.empty(CFG.num_heads).uniform_(1, 16, generator=gen).log()
            elif name == "dt_bias":
                t.copy_(torch.randn(t.shape, generator=gen))
            elif t.dim() == 1:
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 1.5 / math.sqrt(t.shape[-1]))
    return layer


def batch(num_tokens: int, decode: bool) -> ForwardBatch:
    return ForwardBatch(cu_seqlens=torch.tensor([0, num_tokens]), cu_seqlens_host=(0, num_tokens),
                        context_lens=torch.tensor([num_tokens]),
                        num_decodes=int(decode), state_indices=torch.tensor([1]),
                        block_tables=torch.zeros(1, 1, dtype=torch.long), slot_mapping=torch.zeros(num_tokens))


def cache(layer: KDAttention, state_dtype: torch.dtype) -> KDALayerCache:
    p = CFG.proj_dim
    return KDALayerCache(torch.zeros(2, CFG.num_heads, CFG.head_dim, CFG.head_dim, dtype=state_dtype),
                         torch.zeros(2, 3 * p, CFG.conv_kernel_size - 1, dtype=layer.q_conv1d.dtype))


# fp64 is not held to fp64 rounding: beta is rounded to fp32 (as transformers does), so a last-bit difference between
# the 100-row and the 1-row projection GEMMs can move it by one fp32 ulp (seen: 1.6e-8 relative on an AVX-512 CPU).
# The ops' own fp64 chunked-vs-recurrent parity is tested at 1e-12 in tests/ops/test_kda.py.
@pytest.mark.parametrize("dtype, fp32_params, tol", [(torch.float64, False, 1e-6), (torch.float32, True, 1e-5)],
                         ids=["fp64", "fp32-k3-params"])
def test_k3_kda_chunked_equals_recurrent(dtype: torch.dtype, fp32_params: bool, tol: float) -> None:
    """100 tokens in one chunked prefill (chunks of 64) give the outputs and final state of 100 recurrent decode
    steps, with K3's steep bounded gate (log-decay down to -5 per step)."""
    layer = k3_kda(dtype, fp32_params)
    x = torch.randn(100, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    full_cache, step_cache = cache(layer, state_dtype), cache(layer, state_dtype)
    with torch.inference_mode():
        full = layer(x, batch(100, decode=False), full_cache)
        steps = torch.cat([layer(x[t : t + 1], batch(1, decode=True), step_cache) for t in range(100)])
    assert (full - steps).abs().max() <= tol * full.abs().max()
    assert (full_cache.state - step_cache.state).abs().max() <= tol * full_cache.state.abs().max()
    assert (full_cache.conv - step_cache.conv).abs().max() <= tol * full_cache.conv.abs().max()  # GEMM rounding


def test_k3_kda_parameters_and_gate() -> None:
    """A_log is a flat [128] (first H used), conv and o_norm stay fp32 in a bf16 layer; the gate is
    g = lb * sigmoid(exp(A_log) * (f + dt_bias)) in [lb, 0], not a clamp of the softplus gate."""
    layer = k3_kda(torch.bfloat16, fp32_params=True)
    assert layer.A_log.shape == (128,) and not layer.A_log[CFG.num_heads :].any()
    assert layer.q_conv1d.dtype == torch.float32 and layer.o_norm.weight.dtype == torch.float32
    assert layer.in_proj.weight.dtype == torch.bfloat16 and "g_proj.weight" in layer.checkpoint_tensors()
    f = torch.randn(7, CFG.num_heads, CFG.head_dim, generator=torch.Generator().manual_seed(2)) * 30
    g = kda_gate(f, layer.A_log, layer.dt_bias, -5.0)
    a = layer.A_log[: CFG.num_heads].exp().view(1, -1, 1)
    assert torch.equal(g, -5.0 * torch.sigmoid(a * (f + layer.dt_bias.view(1, CFG.num_heads, -1))))
    assert (g >= -5).all() and (g <= 0).all() and (g > -5).any()  # in fp32 sigmoid saturates to exactly 0 / 1
