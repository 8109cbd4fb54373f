"""MoonViT's patch embedding: each patch's pixels projected to the tower width, plus its position embedding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.config.vision import VisionConfig
from deltaserve.ops.vision import Grid, interpolate_pos_emb, time_embedding


class VisionPatchEmbed(nn.Module):
    """`proj` (a conv with kernel = stride = patch_size, i.e. a linear map of each patch) and `pos_emb` (the learned
    position grid, resampled to each image's patch grid)."""

    time_table: Tensor
    """``[pos_emb_time, D]`` fp32, the frames' sinusoidal embedding (not a checkpoint tensor)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        p, d = config.patch_size, config.hidden_size
        self.proj_weight = nn.Parameter(torch.empty(d, 3, p, p, dtype=dtype), requires_grad=False)
        self.proj_bias = nn.Parameter(torch.empty(d, dtype=dtype), requires_grad=False)
        self.pos_emb = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, d, dtype=dtype),
                                    requires_grad=False)
        self.register_buffer("time_table", time_embedding(config.pos_emb_time, d), persistent=False)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        return {"proj.weight": self.proj_weight, "proj.bias": self.proj_bias, "pos_emb.weight": self.pos_emb}

    def forward(self, pixel_values: Tensor, grid_thw: Sequence[Grid]) -> Tensor:
        """pixel_values: ``[n, 3, p, p]`` -> ``[n, D]``."""
        x = F.linear(pixel_values.to(self.proj_weight.dtype).flatten(1), self.proj_weight.flatten(1), self.proj_bias)
        return x + interpolate_pos_emb(self.pos_emb, grid_thw, self.time_table)
