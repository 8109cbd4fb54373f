"""Decode roofline of a loaded model: bytes and FLOPs per decode step, device ceilings, share reached.

The bytes-per-step model is `metrics-and-roofline.md` §4: every weight that a decode step touches is read once
(non-expert weights and the LM head always; routed experts only as many as uniform top-k routing of B rows is
expected to touch), each sequence's KDA state slot is read and written, and each full-attention layer reads its KV
rows. The bound time of a step is max(bytes / bandwidth, FLOPs / peak FLOP/s); "share of roofline" is the bound time
over the measured step time, so 100% means the step runs at the memory (or compute) ceiling.

Sizes come from the model as loaded (runtime dtype, MXFP4 experts still packed), not from the checkpoint files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.layers.latent_moe import LatentMoE
from deltaserve.layers.moe import MoE
from deltaserve.models.protocol import Model

# Achievable ceilings measured on one H200 (metrics-and-roofline.md §3): read-only HBM bandwidth and bf16 GEMM rate.
KNOWN_CEILINGS: dict[str, tuple[float, float]] = {"H200": (4.26e12, 800e12)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelBytes:
    """What one decode step reads, per the §4 model."""

    dense_bytes: int
    """Weights every step reads: attention projections, routers, shared experts, dense layers, norms, LM head
    (the embedding table is excluded: a step reads only B of its rows)."""
    expert_bytes: int
    """Bytes of one routed expert (all its tensors, as stored at run time)."""
    num_moe_layers: int
    num_experts: int
    top_k: int
    state_bytes_per_seq: int
    """KDA recurrent state + conv window of one sequence, all KDA layers."""
    kv_bytes_per_token: int
    """MLA KV rows of one token, all full-attention layers."""
    active_params: int
    """Parameters one token multiplies through (dense + top_k experts per MoE layer), for the FLOP count."""

    def experts_touched(self, batch: int) -> float:
        """E · (1 − (1 − k/E)^B): expected distinct experts per MoE layer under uniform routing."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def step_bytes(self, contexts: list[int]) -> float:
        """Bytes read and written by one decode step of len(contexts) sequences with these context lengths."""
        b = len(contexts)
        weights = self.dense_bytes + self.num_moe_layers * self.experts_touched(b) * self.expert_bytes
        caches = b * 2 * self.state_bytes_per_seq + self.kv_bytes_per_token * sum(contexts)
        return weights + caches

    def step_flops(self, batch: int) -> float:
        """Weight FLOPs of one decode step (2 per parameter per token; attention FLOPs are left out)."""
        return 2.0 * self.active_params * batch


def _ids(part: nn.Module | torch.Tensor | None) -> set[int]:
    if part is None:
        return set()
    return {id(part)} if isinstance(part, torch.Tensor) else {id(t) for t in part.parameters()}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_bytes(model: Model) -> ModelBytes:
    """Split a loaded deltaserve model's tensors into the §4 categories."""
    embed_ids = _ids(getattr(model, "embed_tokens", None)) - _ids(getattr(model, "lm_head", None))  # tied: kept
    expert_ids: set[int] = set()
    moe_layers, experts, top_k, expert_bytes, expert_params = 0, 0, 0, 0, 0
    for module in model.modules():
        if not isinstance(module, MoE | LatentMoE):
            continue
        routed = [(name, t) for name, t in [*module.named_parameters(), *module.named_buffers()]
                  if name.split(".")[0] in ("w13", "w2")]
        expert_ids |= {id(t) for _, t in routed}
        moe_layers += 1
        experts, top_k = module.cfg.num_experts, module.cfg.top_k
        expert_bytes = sum(_tensor_bytes(t) for _, t in routed) // experts
        # MXFP4 packs two weights per byte and its scales are not weights: count logical weights for the FLOPs.
        expert_params = sum(2 * t.numel() if name.endswith("weight_packed") else 0 if "scale" in name else t.numel()
                            for name, t in routed) // experts
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    dense = [t for i, t in tensors.items() if i not in expert_ids and i not in embed_ids]
    dense_bytes = sum(_tensor_bytes(t) for t in dense)
    specs = model.cache_specs()
    return ModelBytes(
        dense_bytes=dense_bytes, expert_bytes=expert_bytes, num_moe_layers=moe_layers, num_experts=experts,
        top_k=top_k, state_bytes_per_seq=sum(s.bytes_per_slot for s in specs if isinstance(s, StateCacheSpec)),
        kv_bytes_per_token=sum(s.bytes_per_token for s in specs if isinstance(s, KVCacheSpec)),
        active_params=sum(t.numel() for t in dense) + moe_layers * top_k * expert_params,
    )


@dataclass(frozen=True, slots=True)
class DeviceCeilings:
    """Achievable memory bandwidth (bytes/s) and FLOP rate of a device, and where the numbers came from."""

    bandwidth: float
    flops: float
    source: str


def measure_ceilings(device: torch.device, dtype: torch.dtype, *, nbytes: int = 1 << 30,
                     bandwidth: float | None = None) -> DeviceCeilings:
    """Read-only bandwidth (a sum over a `nbytes` tensor) and GEMM rate (a square matmul), best of 5 each.

    A known GPU (KNOWN_CEILINGS) uses the measured figures of the roofline document instead. `bandwidth` (bytes/s),
    when given, is used as it is and only the GEMM rate is measured.
    """
    if device.type == "cuda" and bandwidth is None:
        name = torch.cuda.get_device_name(device)
        for key, (bw, fl) in KNOWN_CEILINGS.items():
            if key in name:
                return DeviceCeilings(bw, fl, f"{key} figures of metrics-and-roofline.md §3")
    if bandwidth is None:
        # The sum reads the tensor once; one pass over a tensor far larger than the caches measures memory.
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        bandwidth = nbytes / _best_seconds(device, x.sum, reps=5)
        source = f"measured on {device.type} (sum of {nbytes >> 20} MiB, "
    else:
        source = f"bandwidth given; measured on {device.type} ("
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3 / _best_seconds(device, lambda: a @ a, reps=3)
    return DeviceCeilings(bandwidth, flops, f"{source}{n}^3 matmul)")


def _best_seconds(device: torch.device, fn, *, reps: int) -> float:
    """Fastest of `reps` timed calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True, slots=True)
class RooflineShare:
    """Decode steps measured against their bound."""

    steps: int
    mean_batch: float
    mean_step_ms: float
    mean_bound_ms: float
    mean_bytes: float

    @property
    def share(self) -> float:
        return self.mean_bound_ms / self.mean_step_ms if self.mean_step_ms else 0.0


def roofline_share(mb: ModelBytes, ceilings: DeviceCeilings,
                   steps: list[tuple[list[int], float]]) -> RooflineShare:
    """Share of the roofline over decode steps given as (context length of each sequence, measured seconds)."""
    if not steps:
        return RooflineShare(0, 0.0, 0.0, 0.0, 0.0)
    nbytes = [mb.step_bytes(ctx) for ctx, _ in steps]
    bounds = [max(b / ceilings.bandwidth, mb.step_flops(len(ctx)) / ceilings.flops)
              for b, (ctx, _) in zip(nbytes, steps, strict=True)]
    n = len(steps)
    return RooflineShare(
        steps=n, mean_batch=sum(len(c) for c, _ in steps) / n, mean_step_ms=1e3 * sum(s for _, s in steps) / n,
        mean_bound_ms=1e3 * sum(bounds) / n, mean_bytes=sum(nbytes) / n,
    )
