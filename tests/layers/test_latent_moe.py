"""K3 LatentMoE (model-spec §6) against its definition token by token, and MXFP4 experts against the same experts
dequantised into a dense layer."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.config import ActivationConfig, MoEConfig, QuantizationConfig
from deltaserve.layers.latent_moe import LatentMoE
from deltaserve.models.quantize import quantize_expert_tensors
from deltaserve.ops.mxfp4 import mxfp4_dequantize

CFG = MoEConfig(num_experts=6, top_k=3, intermediate_size=32, num_shared_experts=2, scoring_func="sigmoid",
                num_expert_group=2, topk_group=1, renormalize=True, routed_scaling_factor=1.0, latent_size=64,
                latent_use_norm=True)
ACT = ActivationConfig(kind="situ", situ_beta=4.0, situ_linear_beta=25.0)
D, EPS = 48, 1e-5


def dense_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights with dense experts (`experts.{e}.w{1,2,3}.weight`)."""
    skeleton = LatentMoE(CFG, D, ACT, EPS, torch.float32, quantization=None)
    out = {}
    for name, t in skeleton.checkpoint_tensors().items():
        if t.dim() == 1:
            out[name] = (1 + 0.3 * torch.randn(t.shape, generator=gen)) if "norm" in name else \
                0.2 * torch.randn(t.shape, generator=gen)
        else:
            out[name] = torch.randn(t.shape, generator=gen) * 1.5 / math.sqrt(t.shape[-1])
    return out


def load(layer: LatentMoE, tensors: dict[str, torch.Tensor]) -> LatentMoE:
    targets = layer.checkpoint_tensors()
    assert set(targets) == set(tensors)
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name].copy_(t)
    return layer


def mxfp4_and_dense(dtype: torch.dtype, seed: int = 0) -> tuple[LatentMoE, LatentMoE]:
    """The same experts as MXFP4 and as a dense layer holding the dequantised values."""
    tensors, count = quantize_expert_tensors(dense_weights(torch.Generator().manual_seed(seed)))
    assert count == 3 * CFG.num_experts
    quant = load(LatentMoE(CFG, D, ACT, EPS, dtype, QuantizationConfig(layout="compressed-tensors")), tensors)
    dense = {}
    for name, t in tensors.items():
        if name.endswith("weight_packed"):
            base = name.removesuffix("_packed")
            dense[base] = mxfp4_dequantize(t, tensors[base + "_scale"], torch.float64)
        elif not name.endswith("weight_scale"):
            dense[name] = t
    return quant, load(LatentMoE(CFG, D, ACT, EPS, dtype, quantization=None), dense)


def by_definition(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Per token in fp64: out = up(RMSNorm(sum_j w_j SiTU(z W1_j^T, z W3_j^T) W2_j^T)) + down_s(SiTU(x G^T, x U^T))
    with z = x Wdown^T; the router's choice is taken from the layer (routing is tested against transformers)."""
    from deltaserve.layers.moe import route_tokens

    weights, ids = route_tokens(x, moe.gate_weight, moe.correction_bias, CFG)
    w = {k: v.double() for k, v in moe.checkpoint_tensors().items()}

    def situ(g, u):
        return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)

    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        z = w["routed_expert_down_proj.weight"] @ xt
        routed = sum(weights[t, j].double() * (w[f"experts.{e}.w2.weight"] @ situ(
            w[f"experts.{e}.w1.weight"] @ z, w[f"experts.{e}.w3.weight"] @ z)) for j, e in enumerate(ids[t].tolist()))
        normed = w["routed_expert_norm.weight"] * routed / torch.sqrt(routed.pow(2).mean() + EPS)
        shared = w["shared_experts.down_proj.weight"] @ situ(w["shared_experts.gate_proj.weight"] @ xt,
                                                             w["shared_experts.up_proj.weight"] @ xt)
        out[t] = w["routed_expert_up_proj.weight"] @ normed + shared
    return out


def test_latent_moe_matches_definition() -> None:
    """fp64 dense-expert LatentMoE equals the per-token definition (late weights, norm, up, shared SiTU); 1e-6
    because `ops.norm.rms_norm` normalises in fp32 even for fp64 inputs (as transformers)."""
    _, dense = mxfp4_and_dense(torch.float64)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = by_definition(dense, x)
    assert (dense(x) - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_experts_equal_dequantised_dense_experts(dtype: torch.dtype, default_dispatch) -> None:
    """MXFP4 experts dequantised on the fly give bit-identical outputs to a dense layer holding the decoded weights
    (the decode is exact in bf16 and fp32); the packed layer stores 4.25 bits per weight. Both loop over the experts
    (the reference: dense stacks this small would otherwise take the every-expert `cpu_dense` path, other bits)."""
    from deltaserve.ops import dispatch

    default_dispatch.setenv("DELTASERVE_OPS_BACKEND", "moe_experts=ref")
    dispatch.reset()
    quant, dense = mxfp4_and_dense(dtype)
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(quant(x), dense(x))
    packed_bytes = sum(p.numel() for n, p in quant.named_parameters() if p.dtype == torch.uint8)
    assert packed_bytes * 8 == 4.25 * CFG.num_experts * 3 * CFG.intermediate_size * CFG.latent_size


def test_mxfp8_activations_flag() -> None:
    """MXFP8 activation rounding changes the MXFP4 expert output slightly (E4M3: ~2**-4 relative per element)."""
    quant, _ = mxfp4_and_dense(torch.float32)
    tensors = {k: v.detach().clone() for k, v in quant.checkpoint_tensors().items()}
    fp8 = load(LatentMoE(CFG, D, ACT, EPS, torch.float32, QuantizationConfig(layout="compressed-tensors"),
                         mxfp8_activations=True), tensors)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(3))
    a, b = quant(x), fp8(x)
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert 0 < rel < 0.1


def test_latent_moe_expert_layout_names() -> None:
    """compressed-tensors: per expert w1/w2/w3 weight_packed [out, in/2] and weight_scale [out, in/32];
    gpt-oss: stacked gate_up/down blocks [E, rows, in/32, 16] and scales."""
    ct = LatentMoE(CFG, D, ACT, EPS, torch.float32, QuantizationConfig(layout="compressed-tensors"))
    names = {k: tuple(v.shape) for k, v in ct.checkpoint_tensors().items() if k.startswith("experts.0.")}
    assert names == {"experts.0.w1.weight_packed": (32, 32), "experts.0.w1.weight_scale": (32, 2),
                     "experts.0.w3.weight_packed": (32, 32), "experts.0.w3.weight_scale": (32, 2),
                     "experts.0.w2.weight_packed": (64, 16), "experts.0.w2.weight_scale": (64, 1)}
    oss = LatentMoE(CFG, D, ACT, EPS, torch.float32, QuantizationConfig(layout="gpt-oss"))
    names = {k: tuple(v.shape) for k, v in oss.checkpoint_tensors().items() if k.startswith("experts.")}
    assert names == {"experts.gate_up_proj_blocks": (6, 64, 2, 16), "experts.gate_up_proj_scales": (6, 64, 2),
                     "experts.down_proj_blocks": (6, 64, 1, 16), "experts.down_proj_scales": (6, 64, 1)}
    layer = LatentMoE(CFG, D, ACT, EPS, torch.float32, QuantizationConfig(layout="gpt-oss"))
    with torch.no_grad():
        layer.w13.weight_packed.copy_(torch.arange(6 * 64 * 32).view(6, 64, 32) % 256)
    # Interleaved rows: row 2j is the gate (w1) row j, row 2j + 1 the up (w3) row j.
    ct_view = LatentMoE(CFG, D, ACT, EPS, torch.float32, QuantizationConfig(layout="compressed-tensors"))
    with torch.no_grad():
        ct_view.w13.weight_packed.copy_(layer.w13.weight_packed)
    assert torch.equal(ct_view.checkpoint_tensors()["experts.2.w3.weight_packed"], layer.w13.weight_packed[2, 1::2])
