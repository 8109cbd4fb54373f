"""Kimi K3's LatentMoE (model-spec §6): routed experts in a latent width, MXFP4 (or dense) weights, SiTU, late
routing weights, RMSNorm and an up projection, plus shared experts on the full width."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ActivationConfig, MoEConfig, QuantizationConfig
from deltaserve.layers.linear import Linear, NormWeight
from deltaserve.layers.moe import GatedMLP, gated_activation, route_tokens
from deltaserve.layers.mxfp4_linear import MXFP4Linear
from deltaserve.ops.moe import moe_experts
from deltaserve.ops.mxfp4 import BLOCK_SIZE, MXFP4Tensor, mxfp4_linear
from deltaserve.ops.norm import rms_norm


class LatentMoE(nn.Module):
    """``out = up(RMSNorm(sum_j w_j * Expert_j(down(x)))) + Shared(x)`` with the router on the full ``x``.

    Routed-expert gate and up rows are stored **interleaved** (row ``2j`` is w1 row ``j``, row ``2j + 1`` is w3 row
    ``j``), the order of gpt-oss's stacked tensors, so the compressed-tensors and gpt-oss MXFP4 layouts both load
    through views. Each expert's output is rounded to the activation dtype, weighted in fp32 and summed in fp32
    (NeMo's reference order, "matching the checkpoint implementation").
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, act: ActivationConfig, rms_norm_eps: float,
                 dtype: torch.dtype, quantization: QuantizationConfig | None, mxfp8_activations: bool = False) -> None:
        """`quantization` None: dense routed experts in `dtype`; else MXFP4 in its `layout`. `mxfp8_activations`
        rounds the expert GEMM inputs through MXFP8 (MXFP4 experts only)."""
        super().__init__()
        if cfg.latent_size is None:
            raise ValueError("LatentMoE needs MoEConfig.latent_size (routed_expert_hidden_size)")
        e, i, lat = cfg.num_experts, cfg.intermediate_size, cfg.latent_size
        self.cfg, self.eps, self.quantization = cfg, rms_norm_eps, quantization
        self.latent_size = lat  # cfg.latent_size, checked not None above
        # Router weight and selection bias stay fp32 (model-spec §5).
        self.gate_weight = nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False)
        self.correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
        self.routed_expert_down_proj = Linear(hidden_size, lat, dtype)
        self.routed_expert_up_proj = Linear(lat, hidden_size, dtype)
        self.routed_expert_norm = NormWeight(lat, dtype) if cfg.latent_use_norm else None
        self.w13: MXFP4Linear | nn.Parameter
        self.w2: MXFP4Linear | nn.Parameter
        if quantization is None:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, lat, dtype=dtype), requires_grad=False)  # interleaved
            self.w2 = nn.Parameter(torch.empty(e, lat, i, dtype=dtype), requires_grad=False)
            self._linear = F.linear
        else:
            self.w13 = MXFP4Linear(lat, 2 * i, num_experts=e)
            self.w2 = MXFP4Linear(i, lat, num_experts=e)
            self._linear = partial(mxfp4_linear, mxfp8_activations=mxfp8_activations)
        self._act = gated_activation(act, interleaved=True)
        self.shared_experts = (
            GatedMLP(hidden_size, i * cfg.num_shared_experts, dtype, act=gated_activation(act))
            if cfg.num_shared_experts else None
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = {
            "gate.weight": self.gate_weight,
            "gate.e_score_correction_bias": self.correction_bias,
            "routed_expert_down_proj.weight": self.routed_expert_down_proj.weight,
            "routed_expert_up_proj.weight": self.routed_expert_up_proj.weight,
        }
        if self.routed_expert_norm is not None:
            named["routed_expert_norm.weight"] = self.routed_expert_norm.weight
        named.update(self._expert_tensors())
        if self.shared_experts is not None:
            named.update({f"shared_experts.{k}": v for k, v in self.shared_experts.checkpoint_tensors().items()})
        return named

    def _dense_experts(self) -> tuple[nn.Parameter, nn.Parameter]:
        """``w13 [E, 2I, latent]`` (interleaved), ``w2 [E, latent, I]``; only without quantization."""
        w13, w2 = self.w13, self.w2
        assert isinstance(w13, nn.Parameter) and isinstance(w2, nn.Parameter), "routed experts are MXFP4"
        return w13, w2

    def _mxfp4_experts(self) -> tuple[MXFP4Linear, MXFP4Linear]:
        """The stacked MXFP4 holders of w13 and w2; only with quantization."""
        w13, w2 = self.w13, self.w2
        assert isinstance(w13, MXFP4Linear) and isinstance(w2, MXFP4Linear), "routed experts are dense"
        return w13, w2

    def _expert_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint names of the routed experts in the configured layout (model-spec §9.2, §10.2, §10.3)."""
        pairs: list[tuple[str, torch.Tensor, torch.Tensor]]
        if self.quantization is None:
            pairs = [("weight", *self._dense_experts())]
        else:
            layout = self.quantization.layout
            q13, q2 = self._mxfp4_experts()
            if layout == "gpt-oss":  # stacked, gate/up rows interleaved, blocks of 16 bytes
                e, i, lat = self.cfg.num_experts, self.cfg.intermediate_size, self.latent_size
                return {
                    "experts.gate_up_proj_blocks": q13.weight_packed.view(e, 2 * i, lat // BLOCK_SIZE, 16),
                    "experts.gate_up_proj_scales": q13.weight_scale,
                    "experts.down_proj_blocks": q2.weight_packed.view(e, lat, i // BLOCK_SIZE, 16),
                    "experts.down_proj_scales": q2.weight_scale,
                }
            if layout != "compressed-tensors":
                raise ValueError(f"unknown MXFP4 layout {layout!r}")
            pairs = [("weight_packed", q13.weight_packed, q2.weight_packed),
                     ("weight_scale", q13.weight_scale, q2.weight_scale)]
        named: dict[str, torch.Tensor] = {}
        for suffix, w13, w2 in pairs:
            for e in range(self.cfg.num_experts):
                named[f"experts.{e}.w1.{suffix}"] = w13[e, 0::2]
                named[f"experts.{e}.w3.{suffix}"] = w13[e, 1::2]
                named[f"experts.{e}.w2.{suffix}"] = w2[e]
        return named

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, d]`` (after post_attention_layernorm) -> ``[T, d]``."""
        weights, ids = route_tokens(x, self.gate_weight, self.correction_bias, self.cfg)
        z = self.routed_expert_down_proj(x)  # [T, latent]
        w13: torch.Tensor | MXFP4Tensor
        w2: torch.Tensor | MXFP4Tensor
        if self.quantization is None:
            w13, w2 = self._dense_experts()
        else:
            q13, q2 = self._mxfp4_experts()
            w13, w2 = q13.weight, q2.weight
        routed = moe_experts(z, w13, w2, weights, ids, act=self._act, linear=self._linear, fp32_combine=True)
        if self.routed_expert_norm is not None:
            routed = rms_norm(routed, self.routed_expert_norm.weight, self.eps)
        out = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
