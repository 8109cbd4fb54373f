"""Gated activations for the MLPs and experts: SiLU-GLU (model-spec §5) and K3's SiTU (§6). The references `ref_*`
and the dispatched ops layers call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops import dispatch


def ref_silu_and_mul(gate_up: Tensor) -> Tensor:
    """SiLU-GLU on a fused gate/up projection.

    Args:
        gate_up: ``[..., 2I]``; the first ``I`` channels are the gate (w1), the last ``I`` the up projection (w3).

    Returns:
        ``[..., I]`` tensor in ``gate_up.dtype``: ``SiLU(gate) * up``.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def situ(gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU (Kimi K3): ``beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta)``.

    Args:
        gate: ``[..., I]`` gate projection ``g`` (sigmoid takes the uncapped ``g``).
        up: same shape, up projection ``u``.
        beta: beta_1 (``activation_situ_beta``, 4.0 in K3).
        linear_beta: beta_2 (``activation_situ_linear_beta``, 25.0 in K3); ``None`` leaves ``u`` unchanged.

    Returns:
        ``[..., I]`` in ``gate.dtype``, computed in fp32 (fp64 for fp64 inputs); ``|out| <= beta * linear_beta``.
    """
    cdt = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(cdt), up.to(cdt)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * u).to(gate.dtype)


def ref_situ_and_mul(gate_up: Tensor, beta: float, linear_beta: float | None, interleaved: bool = False) -> Tensor:
    """SiTU-GLU on a fused gate/up projection ``[..., 2I] -> [..., I]``.

    Args:
        gate_up: the first ``I`` channels are the gate and the last ``I`` the up projection, or with
            ``interleaved`` channel ``2j`` is gate ``j`` and ``2j + 1`` is up ``j`` (gpt-oss row order).
        beta, linear_beta: see `situ`.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    if interleaved:
        return situ(gate_up[..., 0::2], gate_up[..., 1::2], beta, linear_beta)
    gate, up = gate_up.chunk(2, dim=-1)
    return situ(gate, up, beta, linear_beta)


silu_and_mul = dispatch.op("silu_and_mul", ref_silu_and_mul)
situ_and_mul = dispatch.op("situ_and_mul", ref_situ_and_mul)
