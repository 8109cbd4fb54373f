"""The multimodal projector (`mm_projector`, a patch-merger MLP): merged vision tokens to the language model's
hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.config.vision import VisionConfig
from deltaserve.layers.vision.encoder_block import LayerNorm, Linear


class VisionProjector(nn.Module):
    """``proj.2(gelu(proj.0(flatten(pre_norm(x)))))``: each patch of a merged token normalised on its own (width
    `projector_hidden_size`), the token's patches concatenated, then a two-layer MLP with exact GELU."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        merged = config.merged_hidden_size
        self.pre_norm = LayerNorm(config.projector_hidden_size, config.projector_ln_eps, dtype)
        self.proj0 = Linear(merged, merged, dtype)
        self.proj2 = Linear(merged, config.text_hidden_size, dtype)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        named = {f"pre_norm.{k}": v for k, v in self.pre_norm.checkpoint_tensors().items()}
        named.update({f"proj.0.{k}": v for k, v in self.proj0.checkpoint_tensors().items()})
        named.update({f"proj.2.{k}": v for k, v in self.proj2.checkpoint_tensors().items()})
        return named

    def forward(self, merged: Tensor) -> Tensor:
        """merged: ``[m, merge_area, D]`` -> ``[m, text_hidden_size]``."""
        x = self.pre_norm(merged).flatten(1)
        return self.proj2(F.gelu(self.proj0(x)))
