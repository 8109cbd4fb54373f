"""MXFP4 weight holder: packed E2M1 codes and E8M0 scales as uint8 parameters, dequantised on the fly (ops.mxfp4)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops.mxfp4 import BLOCK_SIZE, MXFP4Tensor, mxfp4_linear


class MXFP4Linear(nn.Module):
    """``y = x W^T`` with ``W [out, in]`` in MXFP4, or a stack of ``num_experts`` such matrices ``[E, out, in]``.

    Parameters (uint8, compressed-tensors layout, model-spec §10.2): ``weight_packed [..., out, in/2]`` (low nibble =
    even column) and ``weight_scale [..., out, in/32]`` (E8M0). 4.25 bits per weight.
    """

    def __init__(self, in_features: int, out_features: int, num_experts: int | None = None,
                 mxfp8_activations: bool = False) -> None:
        super().__init__()
        if in_features % BLOCK_SIZE:
            raise ValueError(f"MXFP4 needs in_features divisible by {BLOCK_SIZE}, got {in_features}")
        lead = () if num_experts is None else (num_experts,)
        self.mxfp8_activations = mxfp8_activations
        self.weight_packed = nn.Parameter(torch.empty(*lead, out_features, in_features // 2, dtype=torch.uint8),
                                          requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(*lead, out_features, in_features // BLOCK_SIZE, dtype=torch.uint8), requires_grad=False
        )

    @property
    def weight(self) -> MXFP4Tensor:
        return MXFP4Tensor(self.weight_packed, self.weight_scale)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight_packed": self.weight_packed, "weight_scale": self.weight_scale}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One matrix only (a stack is consumed per expert by the MoE op)."""
        return mxfp4_linear(x, self.weight, self.mxfp8_activations)
