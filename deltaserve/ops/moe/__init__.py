"""MoE routing and grouped experts: the only entry points layers call, dispatched. `moe_experts` has the sorted
grouped-GEMM backend (`sorted.py`) for dense SiLU-GLU experts; everything else runs the reference."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.moe import ref, sorted

moe_route = dispatch.op("moe_route", ref.moe_route)
moe_experts = dispatch.op("moe_experts", ref.moe_experts)
dispatch.register(
    "moe_experts",
    dispatch.Backend("sorted", sorted.moe_experts_sorted, available=sorted.available, supports=sorted.supports),
)

__all__ = ["moe_experts", "moe_route"]
