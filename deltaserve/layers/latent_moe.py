"""Kimi K3's LatentMoE (model-spec §6): routed experts in a latent width, MXFP4 (or dense) weights, SiTU, late
routing weights, RMSNorm and an up projection, plus shared experts on the full width."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ActivationConfig, MoEConfig, QuantizationConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard, split_along
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.layers.expert_placement import ExpertPlacement
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
                 dtype: torch.dtype, quantization: QuantizationConfig | None, mxfp8_activations: bool = False, *,
                 tp: ParallelGroup = SINGLE, expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        """`quantization` None: dense routed experts in `dtype`; else MXFP4 in its `layout`. `mxfp8_activations`
        rounds the expert GEMM inputs through MXFP8 (MXFP4 experts only). `tp`, `expert_parallel`: the routed
        experts are sharded or partitioned (`ExpertPlacement`; an MXFP4 shard keeps whole 32-value scale blocks) and
        their latent partial sums added over the ranks before the norm; the shared experts are sharded; the router
        and the latent down and up projections are whole on every rank. `replicas`: the routed experts span
        data-parallel replicas (`MoE`)."""
        super().__init__()
        if cfg.latent_size is None:
            raise ValueError("LatentMoE needs MoEConfig.latent_size (routed_expert_hidden_size)")
        e, lat = cfg.num_experts, cfg.latent_size
        self.cfg, self.eps, self.quantization, self.tp = cfg, rms_norm_eps, quantization, tp
        self.placement = place = ExpertPlacement(e, cfg.intermediate_size, tp, expert_parallel, eplb, replicas)
        n, i = place.num_local, place.intermediate_size
        if quantization is not None and i % BLOCK_SIZE:
            raise ValueError(f"moe_intermediate_size={cfg.intermediate_size} split over tensor_parallel_size="
                             f"{tp.size} is {i} per rank, not a multiple of the MXFP4 block ({BLOCK_SIZE}): "
                             "use expert parallelism or fewer ranks")
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
            self.w13 = nn.Parameter(torch.empty(n, 2 * i, lat, dtype=dtype), requires_grad=False)  # interleaved
            self.w2 = nn.Parameter(torch.empty(n, lat, i, dtype=dtype), requires_grad=False)
            self._linear = F.linear
        else:
            self.w13 = MXFP4Linear(lat, 2 * i, num_experts=n)
            self.w2 = MXFP4Linear(i, lat, num_experts=n)
            self._linear = partial(mxfp4_linear, mxfp8_activations=mxfp8_activations)
        self._act = gated_activation(act, interleaved=True)
        self.shared_experts = (
            GatedMLP(hidden_size, cfg.intermediate_size * cfg.num_shared_experts, dtype, act=gated_activation(act),
                     tp=tp)
            if cfg.num_shared_experts else None
        )

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        named: dict[str, torch.Tensor | Shard | None] = {
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

    def _expert_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        """Checkpoint names of the routed experts in the configured layout (model-spec §9.2, §10.2, §10.3): this
        rank's slice of each (`ExpertPlacement`), None for another expert-parallel rank's expert."""
        place, full_i = self.placement, self.cfg.intermediate_size
        pairs: list[tuple[str, torch.Tensor, torch.Tensor, int]]  # suffix, w13, w2, values per stored column of w2
        if self.quantization is None:
            pairs = [("weight", *self._dense_experts(), 1)]
        else:
            layout = self.quantization.layout
            q13, q2 = self._mxfp4_experts()
            if layout == "gpt-oss":  # stacked, gate/up rows interleaved, blocks of 16 bytes
                return self._gpt_oss_tensors(q13, q2)
            if layout != "compressed-tensors":
                raise ValueError(f"unknown MXFP4 layout {layout!r}")
            pairs = [("weight_packed", q13.weight_packed, q2.weight_packed, 2),
                     ("weight_scale", q13.weight_scale, q2.weight_scale, BLOCK_SIZE)]
        named: dict[str, torch.Tensor | Shard | None] = {}
        for suffix, w13, w2, per_column in pairs:
            for e in range(self.cfg.num_experts):
                j = place.local_slot(e)
                named[f"experts.{e}.w1.{suffix}"] = None if j is None else place.split(w13[j, 0::2], 0, full_i)
                named[f"experts.{e}.w3.{suffix}"] = None if j is None else place.split(w13[j, 1::2], 0, full_i)
                named[f"experts.{e}.w2.{suffix}"] = None if j is None else place.split(w2[j], 1, full_i // per_column)
        return named

    def _gpt_oss_tensors(self, q13: MXFP4Linear, q2: MXFP4Linear) -> dict[str, torch.Tensor | Shard | None]:
        """The gpt-oss layout: one stacked tensor per kind, split along the experts (expert parallelism) or along
        the intermediate width (tensor parallelism: w13's interleaved rows, w2's blocks)."""
        place, full_e, full_i = self.placement, self.cfg.num_experts, self.cfg.intermediate_size
        n, i, lat = place.num_local, place.intermediate_size, self.latent_size
        tensors = {
            "experts.gate_up_proj_blocks": (q13.weight_packed.view(n, 2 * i, lat // BLOCK_SIZE, 16), 1, 2 * full_i),
            "experts.gate_up_proj_scales": (q13.weight_scale, 1, 2 * full_i),
            "experts.down_proj_blocks": (q2.weight_packed.view(n, lat, i // BLOCK_SIZE, 16), 2, full_i // BLOCK_SIZE),
            "experts.down_proj_scales": (q2.weight_scale, 2, full_i // BLOCK_SIZE),
        }
        tp = self.tp
        if place.expert_parallel:
            if place.eplb is not None and place.eplb.num_redundant_experts:
                raise ValueError("EPLB with redundant experts needs per-expert checkpoint tensors, not the stacked "
                                 "gpt-oss layout")
            return {name: Shard(t, 0, place.first, full_e) for name, (t, _, _) in tensors.items()}
        return {name: split_along(t, dim, full, tp.rank, tp.size) for name, (t, dim, full) in tensors.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, d]`` (after post_attention_layernorm) -> ``[T, d]``."""
        replicas = self.placement.replicas  # experts over data-parallel replicas: every replica's tokens
        tokens, start, count = (x, 0, x.shape[0]) if replicas is None else replicas.gather(x)
        weights, ids = route_tokens(tokens, self.gate_weight, self.correction_bias, self.cfg)
        z = self.routed_expert_down_proj(tokens)  # [T, latent]
        w13: torch.Tensor | MXFP4Tensor
        w2: torch.Tensor | MXFP4Tensor
        stacks: list[torch.Tensor]  # every tensor indexed by expert slot (EPLB moves them)
        if self.quantization is None:
            w13, w2 = self._dense_experts()
            stacks = [w13, w2]
        else:
            q13, q2 = self._mxfp4_experts()
            w13, w2 = q13.weight, q2.weight
            stacks = [q13.weight_packed, q13.weight_scale, q2.weight_packed, q2.weight_scale]
        routed = moe_experts(z, w13, w2, weights, self.placement.route(ids, stacks), act=self._act,
                             linear=self._linear, fp32_combine=True)
        # the norm needs the whole latent sum
        routed = self.tp.all_reduce(routed) if replicas is None else replicas.combine(routed, start, count)
        if self.routed_expert_norm is not None:
            routed = rms_norm(routed, self.routed_expert_norm.weight, self.eps)
        out = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
