"""The transformers oracle for the vision part: `Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection` loaded by
transformers itself from a checkpoint in Moonshot's tensor names (its `kimi_k25` conversion mapping: renames,
the fused `wqkv` split, the rotary permutation of q and k), inside a `Kimi_K25ForConditionalGeneration` with a
tiny DeepSeek-V3 text model (whose weights are left random: only the vision part is compared)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Kimi_K25ForConditionalGeneration
from transformers.utils import logging as hf_logging

from deltaserve.config.vision import VisionConfig


def _text_config(hidden: int) -> dict:
    return {
        "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": hidden, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "n_group": 1, "topk_group": 1,
    }


def oracle_config_dict(config: VisionConfig) -> dict:
    """A `kimi_k25` config.json for transformers with the same vision tower and projector."""
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": _text_config(config.text_hidden_size),
        "vision_config": {
            "model_type": "kimi_k25_vision", "patch_size": config.patch_size,
            "pos_emb_height": config.pos_emb_height, "pos_emb_width": config.pos_emb_width,
            "pos_emb_time": config.pos_emb_time, "num_attention_heads": config.num_attention_heads,
            "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "hidden_act": config.hidden_act,
            "merge_kernel_size": list(config.merge_kernel_size),
            "rope_parameters": {"rope_type": "axial", "rope_theta": config.rope_theta},
        },
        "projection_hidden_size": config.projector_hidden_size,
        "projection_layer_norm_eps": config.projector_ln_eps,
        "torch_dtype": "float32",
    }


def load_oracle(config: VisionConfig, weights: dict[str, torch.Tensor], out: Path
                ) -> Kimi_K25ForConditionalGeneration:
    """Write `weights` (Moonshot names) with an oracle config to `out` and load them with transformers."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(oracle_config_dict(config)))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the text model's weights are missing on purpose
    try:
        model = Kimi_K25ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    tower = model.model.vision_tower
    # Every vision tensor must have come from the file, not from initialisation.
    assert torch.equal(tower.patch_embed.pos_emb.position_embeddings,
                       weights["vision_tower.patch_embed.pos_emb.weight"])
    assert torch.equal(model.model.mm_projector.out_proj.weight, weights["mm_projector.proj.2.weight"])
    return model


def oracle_features(model: Kimi_K25ForConditionalGeneration, pixel_values: torch.Tensor,
                    grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
    """transformers' `get_image_features`: tower, then projector, the images' features concatenated."""
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, torch.tensor(grid_thw, dtype=torch.long))
    return torch.cat(out.pooler_output)
