"""MoE routing and grouped experts: the only entry points layers call, dispatched. `moe_experts` has the sorted
grouped-GEMM backend (`sorted.py`) for dense SiLU-GLU experts and a fused Triton kernel (`triton_moe.py`) for dense
or MXFP4 experts with SiLU-GLU or SiTU, both on CUDA, and on a CPU a C kernel for a few routed pairs (`native.c`:
decode rows, verify chunks) and every-expert batched matmuls for small stacks under many routed pairs
(`cpu_dense.py`); everything else runs the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops import dispatch, triton_backend
from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe import cpu_dense, native, ref, sorted
from deltaserve.ops.moe.fused_spec import fused_act, weight_format
from deltaserve.ops.mxfp4.ref import BLOCK_SIZE, MXFP4Tensor


def _triton_supports(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor | None = None,
                     topk_ids: Tensor | None = None, *, act: Callable[[Tensor], Tensor] = silu_and_mul,
                     linear: Callable[[Tensor, Any], Tensor] = F.linear, fp32_combine: bool = False) -> bool:
    """bf16 / fp32 tokens where the Triton kernels run, an activation and weight format the kernel knows, stacks on
    the tokens' device (MXFP4: both inner dimensions multiples of 32). Asked without importing triton."""
    if not triton_backend.runs_on(x) or x.dtype not in (torch.bfloat16, torch.float32) or fused_act(act) is None:
        return False
    fmt = weight_format(linear)
    if fmt == "dense":
        return all(isinstance(w, Tensor) and w.dim() == 3 and w.dtype == x.dtype and w.device == x.device
                   and w.stride(-1) == 1 for w in (w13, w2))
    if fmt == "mxfp4":
        return (isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor) and w13.packed.dim() == 3
                and w13.packed.device == x.device and x.shape[-1] % BLOCK_SIZE == 0
                and w2.shape[-1] % BLOCK_SIZE == 0)
    return False


moe_route = dispatch.op("moe_route", ref.moe_route)
moe_experts = dispatch.op("moe_experts", ref.moe_experts)
dispatch.register(
    "moe_experts",
    dispatch.Backend("sorted", sorted.moe_experts_sorted, available=sorted.available, supports=sorted.supports),
)
dispatch.register("moe_experts", dispatch.Backend("native", native.moe_experts_native, available=native.available,
                                                  supports=native.supports))
dispatch.register("moe_experts", dispatch.Backend("cpu_dense", cpu_dense.moe_experts_dense,
                                                  supports=cpu_dense.supports))
dispatch.register(  # after `sorted` (dense SiLU-GLU goes there); by name: triton imported only if available
    "moe_experts",
    dispatch.Backend("triton", "deltaserve.ops.moe.triton_moe:moe_experts_triton", available=triton_backend.available,
                     supports=_triton_supports, forced_only=triton_backend.forced_only),
)

__all__ = ["moe_experts", "moe_route"]
