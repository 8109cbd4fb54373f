"""Feed-forward blocks: the dense gated MLP and the routed + shared MoE (model-spec §5)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ActivationConfig, MoEConfig
from deltaserve.layers.linear import pack_parameter
from deltaserve.ops.activation import silu_and_mul, situ_and_mul
from deltaserve.ops.linear import can_pack, linear, pack
from deltaserve.ops.moe import moe_experts, moe_route


class GatedMLP(nn.Module):
    """down(act(gate x, up x)); `act` is SiLU-GLU by default (SiTU for K3). gate and up are loaded into one [2I, d]
    matrix (one GEMM)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        super().__init__()
        self.intermediate_size, self.act = intermediate_size, act
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        i = self.intermediate_size
        return {
            "gate_proj.weight": self.gate_up[:i],
            "up_proj.weight": self.gate_up[i:],
            "down_proj.weight": self.down,
        }

    def prepack(self) -> int:
        return pack_parameter(self, "gate_up") + pack_parameter(self, "down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.act(linear(x, self.gate_up)), self.down)


def gated_activation(cfg: ActivationConfig, interleaved: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[..., 2I] -> [..., I]`` for `cfg` (SiLU-GLU or SiTU); ``interleaved``: gate/up rows alternate (SiTU only)."""
    if cfg.kind == "situ":
        return partial(situ_and_mul, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta, interleaved=interleaved)
    if cfg.kind == "silu" and not interleaved:
        return silu_and_mul
    raise ValueError(f"no gated activation {cfg.kind!r} (interleaved={interleaved})")


def route_tokens(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
                 cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 router (model-spec §5) on ``x [T, d]``: ``(topk_weights [T, k] fp32, topk_ids [T, k])``; fp64 for
    an fp64 model (the fp64 oracle must not round anywhere)."""
    cdt = torch.promote_types(x.dtype, torch.float32)  # fp32 for fp32/bf16 models (unchanged), fp64 for fp64
    logits = F.linear(x.to(cdt), gate_weight.to(cdt))  # [T, E]
    return moe_route(
        logits, correction_bias, top_k=cfg.top_k, num_expert_group=cfg.num_expert_group,
        topk_group=cfg.topk_group, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor, scoring_func=cfg.scoring_func,
    )


class MoE(nn.Module):
    """Sigmoid router with correction bias (fp32), grouped top-k, experts grouped by expert, plus shared experts."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        e, i = cfg.num_experts, cfg.intermediate_size
        # Router weight and selection bias stay fp32 (transformers keeps them in fp32 too).
        self.gate_weight = nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False)
        self.correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
        self.w13: nn.Parameter | nn.ParameterList = nn.Parameter(
            torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2: nn.Parameter | nn.ParameterList = nn.Parameter(
            torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        self.shared_experts = (
            GatedMLP(hidden_size, i * cfg.num_shared_experts, dtype) if cfg.num_shared_experts else None
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        i = self.cfg.intermediate_size
        named: dict[str, torch.Tensor] = {
            "gate.weight": self.gate_weight, "gate.e_score_correction_bias": self.correction_bias,
        }
        w13, w2 = self.w13, self.w2
        assert isinstance(w13, nn.Parameter) and isinstance(w2, nn.Parameter), "the stacks are loaded before prepack"
        for e in range(self.cfg.num_experts):
            named[f"experts.{e}.w1.weight"] = w13[e, :i]
            named[f"experts.{e}.w3.weight"] = w13[e, i:]
            named[f"experts.{e}.w2.weight"] = w2[e]
        if self.shared_experts is not None:
            for name, t in self.shared_experts.checkpoint_tensors().items():
                named[f"shared_experts.{name}"] = t
        return named

    def prepack(self) -> int:
        """Split the expert stacks into one packed weight per expert (indexed like the stacks), so each active
        expert's few-row GEMMs read packed weights; nothing is packed where the CPU linear cannot take them."""
        w13, w2 = self.w13, self.w2
        if not (isinstance(w13, nn.Parameter) and isinstance(w2, nn.Parameter) and can_pack(w13[0])):
            return 0
        del self.w13, self.w2  # registered as parameters: a module attribute cannot change kind in place
        self.w13, self.w2 = (nn.ParameterList(nn.Parameter(pack(w), requires_grad=False) for w in stack)
                             for stack in (w13, w2))
        return 2 * self.cfg.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_tokens(x, self.gate_weight, self.correction_bias, self.cfg)
        # The stacks as loaded take `F.linear` (the grouped-GEMM path accepts those); per-expert packed weights after
        # `prepack` take the packed `ops.linear`.
        packed = isinstance(self.w13, nn.ParameterList)
        y = moe_experts(x, self.w13, self.w2, weights, ids, linear=linear if packed else F.linear)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
