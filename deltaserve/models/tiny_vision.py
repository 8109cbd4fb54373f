"""Tiny random vision towers for test checkpoints: a K3 `vision_config` in Moonshot's names and random
`vision_tower.*` / `mm_projector.*` tensors (`write_tiny_checkpoint` with `TinySpec(vision=True)`, K3 or Kimi
Linear)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.config.vision import VisionConfig, parse_vision
from deltaserve.models.kimi_vision import KimiVisionModel
from deltaserve.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyVisionSpec:
    """Sizes of a tiny vision tower (the real one: patch 14, width 1152, 27 blocks, 16 heads, MLP 4304, 64 x 64
    position grid)."""

    patch_size: int = 14
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 96
    pos_emb_height: int = 8
    pos_emb_width: int = 8
    seed: int = 100


def tiny_vision_config_dict(spec: TinyVisionSpec, text_hidden: int) -> dict[str, Any]:
    """A K3 `vision_config` (Moonshot's MoonViT field names, as Kimi K2.5's config.json)."""
    return {
        "model_type": "kimi_k3_vision",
        "patch_size": spec.patch_size,
        "init_pos_emb_height": spec.pos_emb_height,
        "init_pos_emb_width": spec.pos_emb_width,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": spec.heads,
        "vt_num_hidden_layers": spec.layers,
        "vt_hidden_size": spec.hidden,
        "vt_intermediate_size": spec.intermediate,
        "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": spec.hidden,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden,
    }


def tiny_vision_config(spec: TinyVisionSpec, text_hidden: int) -> VisionConfig:
    """The `VisionConfig` the dict of `tiny_vision_config_dict` parses to."""
    config = parse_vision({"vision_config": tiny_vision_config_dict(spec, text_hidden)}, text_hidden)
    assert config is not None
    return config


def random_vision_weights(config: VisionConfig, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-named random tensors: matrices scaled by fan-in, norms near 1, small biases, a position grid of
    unit scale (so that a wrong resampling or rotary layout moves the outputs well past the test tolerance)."""
    with torch.device("meta"):
        skeleton = KimiVisionModel(config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, target in skeleton.checkpoint_tensors().items():
        assert isinstance(target, torch.Tensor)
        shape = tuple(target.shape)
        if name.endswith("pos_emb.weight"):
            t = torch.randn(shape, generator=gen)
        elif len(shape) == 1 and "norm" in name and name.endswith(".weight"):
            t = 1.0 + 0.3 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # biases
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * 1.5 / math.sqrt(math.prod(shape[1:]))
        out[name] = t.contiguous()
    return out


def attach_tiny_vision(raw: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: Tokenizer, text_hidden: int,
                       spec: TinyVisionSpec | None = None) -> None:
    """Give a tiny checkpoint's config dict and tensors a random vision tower: its `vision_config`,
    `media_placeholder_token_id` = the tokenizer's `<|media_pad|>`, and `vision_tower.*` / `mm_projector.*`."""
    spec = spec or TinyVisionSpec()
    raw["vision_config"] = tiny_vision_config_dict(spec, text_hidden)
    raw["media_placeholder_token_id"] = tokenizer.special_tokens["<|media_pad|>"]
    weights.update(random_vision_weights(tiny_vision_config(spec, text_hidden), spec.seed))
