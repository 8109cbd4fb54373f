"""Feed-forward blocks: the dense gated MLP and the routed + shared MoE (model-spec §5)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ActivationConfig, MoEConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard, shard_range, split_along
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.layers.expert_placement import ExpertPlacement
from deltaserve.layers.linear import pack_parameter
from deltaserve.ops.activation import silu_and_mul, situ_and_mul
from deltaserve.ops.linear import can_pack, linear, pack
from deltaserve.ops.moe import moe_experts, moe_route


class GatedMLP(nn.Module):
    """down(act(gate x, up x)); `act` is SiLU-GLU by default (SiTU for K3). gate and up are loaded into one [2I, d]
    matrix (one GEMM). With `tp` of several ranks each holds `I / tp.size` of the intermediate width (its gate and
    up rows, its down columns) and the partial outputs are summed over the ranks unless `reduce=False` (an owner that
    sums several partials at once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul, *, tp: ParallelGroup = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__()
        self.full_intermediate_size, self.act, self.tp, self.reduce = intermediate_size, act, tp, reduce
        self.intermediate_size = i = shard_range(intermediate_size, tp.rank, tp.size, "intermediate_size")[1]
        self.gate_up = nn.Parameter(torch.empty(2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden_size, i, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard]:
        i, full, tp = self.intermediate_size, self.full_intermediate_size, self.tp
        return {
            "gate_proj.weight": split_along(self.gate_up[:i], 0, full, tp.rank, tp.size),
            "up_proj.weight": split_along(self.gate_up[i:], 0, full, tp.rank, tp.size),
            "down_proj.weight": split_along(self.down, 1, full, tp.rank, tp.size),
        }

    def prepack(self) -> int:
        return pack_parameter(self, "gate_up") + pack_parameter(self, "down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(self.act(linear(x, self.gate_up)), self.down)
        return self.tp.all_reduce(y) if self.reduce else y


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
    """Sigmoid router with correction bias (fp32), grouped top-k, experts grouped by expert, plus shared experts.

    With `tp` of several ranks the router runs whole on every rank; the routed experts are sharded or partitioned
    (`ExpertPlacement`), the shared experts sharded, and the routed and shared partial outputs are summed over the
    ranks in one all-reduce."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, dtype: torch.dtype, *, tp: ParallelGroup = SINGLE,
                 expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        e = cfg.num_experts
        self.placement = ExpertPlacement(e, cfg.intermediate_size, tp, expert_parallel, eplb, replicas)
        n, i = self.placement.num_local, self.placement.intermediate_size
        # Router weight and selection bias stay fp32 (transformers keeps them in fp32 too).
        self.gate_weight = nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False)
        self.correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
        self.w13: nn.Parameter | nn.ParameterList = nn.Parameter(
            torch.empty(n, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2: nn.Parameter | nn.ParameterList = nn.Parameter(
            torch.empty(n, hidden_size, i, dtype=dtype), requires_grad=False)
        self.shared_experts = (
            GatedMLP(hidden_size, cfg.intermediate_size * cfg.num_shared_experts, dtype, tp=tp, reduce=False)
            if cfg.num_shared_experts else None
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        """Router, this rank's experts (another rank's expert tensors map to None: not read) and shared experts."""
        place, full = self.placement, self.cfg.intermediate_size
        i = place.intermediate_size
        named: dict[str, torch.Tensor | Shard | None] = {
            "gate.weight": self.gate_weight, "gate.e_score_correction_bias": self.correction_bias,
        }
        w13, w2 = self.w13, self.w2
        assert isinstance(w13, nn.Parameter) and isinstance(w2, nn.Parameter), "the stacks are loaded before prepack"
        for e in range(self.cfg.num_experts):
            j = place.local_slot(e)
            for name, target, dim in (("w1", None if j is None else w13[j, :i], 0),
                                      ("w3", None if j is None else w13[j, i:], 0),
                                      ("w2", None if j is None else w2[j], 1)):
                named[f"experts.{e}.{name}.weight"] = None if target is None else place.split(target, dim, full)
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
        if self.placement.eplb is not None:
            return 0  # EPLB moves expert weights between ranks: they stay plain stacks
        del self.w13, self.w2  # registered as parameters: a module attribute cannot change kind in place
        self.w13, self.w2 = (nn.ParameterList(nn.Parameter(pack(w), requires_grad=False) for w in stack)
                             for stack in (w13, w2))
        return 2 * len(w13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        replicas = self.placement.replicas
        tokens, start, count = (x, 0, x.shape[0]) if replicas is None else replicas.gather(x)
        weights, ids = route_tokens(tokens, self.gate_weight, self.correction_bias, self.cfg)
        # Per-expert packed weights after `prepack` take the packed `ops.linear`, and so do the stacks as loaded on a
        # CPU (its few-row kernel where the reference loops over experts); elsewhere they take `F.linear` (the
        # grouped-GEMM and Triton paths accept that).
        ops_linear = isinstance(self.w13, nn.ParameterList) or tokens.device.type == "cpu"
        stacks = [self.w13, self.w2] if isinstance(self.w13, nn.Parameter) and isinstance(self.w2, nn.Parameter) else []
        y = moe_experts(tokens, self.w13, self.w2, weights, self.placement.route(ids, stacks),
                        linear=linear if ops_linear else F.linear)
        if self.shared_experts is not None:  # this rank's partial, on this replica's rows: summed with the rest
            shared = self.shared_experts(x)
            y = y + shared if replicas is None else torch.cat((y[:start], y[start:start + count] + shared,
                                                               y[start + count:]))
        return self.tp.all_reduce(y) if replicas is None else replicas.combine(y, start, count)
