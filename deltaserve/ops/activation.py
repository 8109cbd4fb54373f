"""Gated activations for the MLPs and experts (model-spec §5): SiLU-GLU."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(gate_up: Tensor) -> Tensor:
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
