"""MoE routing and grouped experts: the only entry points layers call."""

from __future__ import annotations

from deltaserve.ops.moe.ref import moe_experts, moe_route

__all__ = ["moe_experts", "moe_route"]
