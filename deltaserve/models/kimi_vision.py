"""The Kimi K3 (K2.5-family) vision part: MoonViT and its projector, from preprocessed patches to one
language-model embedding per image placeholder token. Loaded from a K3 checkpoint's `vision_tower.*` and
`mm_projector.*` tensors (Moonshot's names) by the same loader as the language model, which skips them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from deltaserve.config import ModelConfig
from deltaserve.config.vision import VisionConfig
from deltaserve.distributed import Shard
from deltaserve.layers.vision import LayerNorm, VisionEncoderBlock, VisionPatchEmbed, VisionProjector
from deltaserve.layers.vision.encoder_block import LAYER_NORM_EPS
from deltaserve.models.loader import load_weights
from deltaserve.models.protocol import Model
from deltaserve.ops.vision import Grid, cu_seqlens_of, merge_patches, rope_2d_cos_sin

TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."


class KimiVisionModel(nn.Module):
    """Tower (patch embedding, encoder blocks, final LayerNorm, patch merging) and projector.

    `forward(pixel_values, grid_thw)` takes the packed patches of one or more images (`multimodal.preprocess_image`
    output, concatenated in order) and returns their projected features, the images' placeholder tokens in order.
    """

    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.patch_embed = VisionPatchEmbed(config, dtype)
        self.blocks = nn.ModuleList(VisionEncoderBlock(config, dtype) for _ in range(config.num_hidden_layers))
        self.final_layernorm = LayerNorm(config.hidden_size, LAYER_NORM_EPS, dtype)
        self.projector = VisionProjector(config, dtype)

    def checkpoint_tensors(self) -> dict[str, Tensor | Shard | None]:
        """Every tensor this part loads, by its checkpoint name (`vision_tower.*`, `mm_projector.*`)."""
        named: dict[str, Tensor | Shard | None] = {}
        tower = f"{TOWER_PREFIX}patch_embed."
        named.update({tower + k: v for k, v in self.patch_embed.checkpoint_tensors().items()})
        for i, block in enumerate(self.blocks):
            prefix = f"{TOWER_PREFIX}encoder.blocks.{i}."
            named.update({prefix + k: v for k, v in cast(VisionEncoderBlock, block).checkpoint_tensors().items()})
        final = f"{TOWER_PREFIX}encoder.final_layernorm."
        named.update({final + k: v for k, v in self.final_layernorm.checkpoint_tensors().items()})
        named.update({PROJECTOR_PREFIX + k: v for k, v in self.projector.checkpoint_tensors().items()})
        return named

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """A checkpoint name -> itself for a vision tensor; None (skip) for the language model's."""
        return name if name.startswith((TOWER_PREFIX, PROJECTOR_PREFIX)) else None

    def encode(self, pixel_values: Tensor, grid_thw: Sequence[Grid]) -> Tensor:
        """The tower alone: ``[num_patches, 3, p, p]`` -> merged tokens ``[num_tokens, merge_area, D]``."""
        expected = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape[0] != expected:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids {list(grid_thw)} need "
                             f"{expected}")
        x = self.patch_embed(pixel_values, grid_thw)
        cos, sin = rope_2d_cos_sin(grid_thw, self.config.head_dim, self.config.rope_theta)
        cu_seqlens = cu_seqlens_of(grid_thw)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return merge_patches(self.final_layernorm(x), grid_thw, self.config.merge_kernel_size)

    def forward(self, pixel_values: Tensor, grid_thw: Sequence[Grid]) -> Tensor:
        """``[num_patches, 3, p, p]`` patches of the images in `grid_thw` -> ``[num_tokens, text_hidden_size]``,
        num_tokens = the sum over images of h * w / merge_area (a clip's frames are averaged into one grid)."""
        return self.projector(self.encode(pixel_values, grid_thw))


def num_vision_tokens(grid_thw: Sequence[Grid], config: VisionConfig) -> list[int]:
    """Placeholder tokens per image (its merged tokens; a clip's frames share them)."""
    return [h * w // config.merge_area for _, h, w in grid_thw]


def load_vision_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> KimiVisionModel:
    """The vision part of the K3 checkpoint at `path`, its weights read by the model loader (the text tensors
    skipped). Raises ValueError when the checkpoint has no vision tower."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if config.vision is None:
        raise ValueError(f"checkpoint {path} has no vision tower (config field vision_config)")
    with torch.device(device):
        model = KimiVisionModel(config.vision, dtype)
    # `load_weights` reads only `checkpoint_tensors` and `canonical_name`, which this part has; the rest of the
    # `Model` protocol (forward over a ForwardBatch, caches) is the language model's.
    load_weights(cast(Model, model), path)
    return model.eval()
