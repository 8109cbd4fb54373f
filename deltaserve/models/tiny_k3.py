"""Tiny random Kimi K3 checkpoints (`deltaserve make-tiny --arch kimi_k3`): nested config, `language_model.`
tensor names, MXFP4 routed experts, K3's XTML special tokens, and optionally a vision tower (`tiny_vision.py`).
Weights are drawn as for Kimi Linear (`tiny_checkpoint.py`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltaserve.config import ModelConfig
from deltaserve.config.model import K3_ARCHITECTURE
from deltaserve.models.kimi_k3 import KimiK3ForConditionalGeneration
from deltaserve.models.quantize import (
    compressed_tensors_config,
    gpt_oss_config,
    quantize_expert_tensors,
    to_gpt_oss_layout,
)
from deltaserve.models.tiny_checkpoint import random_weights, save_weights, tiny_config_dict, write_metadata
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.models.tiny_vision import TinyVisionSpec, attach_tiny_vision
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer

EXPERT_FORMATS = ("compressed-tensors", "gpt-oss", "dense")


def tiny_k3_config_dict(spec: TinySpec, special_ids: dict[str, int]) -> dict[str, Any]:
    """A K3 config.json: top-level `KimiK3ForConditionalGeneration` / `kimi_k3`, the text model under `text_config`
    (whose model_type, like the real one, says kimi_linear), its `quantization_config` inside it."""
    text = tiny_config_dict(spec, special_ids)  # the flat Kimi Linear fields, in Moonshot names
    text["linear_attn_config"].update(gate_lower_bound=-5.0, use_full_rank_gate=True)
    text.update(
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        routed_expert_hidden_size=spec.latent_size, latent_moe_use_norm=True, mla_use_output_gate=True,
        topk_method="noaux_tc", num_nextn_predict_layers=0,
    )
    if spec.attn_res_block_size is not None:
        text["attn_res_block_size"] = spec.attn_res_block_size
    if spec.expert_format == "compressed-tensors":
        text["quantization_config"] = compressed_tensors_config()
    elif spec.expert_format == "gpt-oss":
        text["quantization_config"] = gpt_oss_config()
    return {
        "architectures": [K3_ARCHITECTURE],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision"},  # out of scope: no vision tensors are written
        "bos_token_id": special_ids["bos_token_id"],
        "eos_token_id": special_ids["eos_token_id"],
        "pad_token_id": special_ids["pad_token_id"],
        "torch_dtype": "float32",
    }


def write_tiny_k3_checkpoint(out_dir: str | Path, spec: TinySpec, *, vision: bool = False,
                             vision_spec: TinyVisionSpec | None = None) -> Path:
    """Write a random K3 checkpoint. Experts are drawn dense, then quantised to MXFP4 unless `expert_format` is
    "dense"; the same seed gives the same (dequantised) weights in every format. `vision`: add a tiny vision tower
    and projector (`vision_spec`, default `TinyVisionSpec()`): its `vision_config`, `media_placeholder_token_id` =
    the tokenizer's `<|media_pad|>`, and `vision_tower.*` / `mm_projector.*` tensors; without it the files are as
    before."""
    if spec.expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format={spec.expert_format!r} must be one of {EXPERT_FORMATS}")
    if spec.dense_name != "mlp":
        raise ValueError("kimi_k3 tiny checkpoints name the dense layers mlp.*")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = write_tiny_tokenizer(out, spec.vocab, flavor="k3")
    raw = tiny_k3_config_dict(spec, special_ids)
    dense_config = ModelConfig.from_dict(tiny_k3_config_dict(replace(spec, expert_format="dense"), special_ids))
    with torch.device("meta"):
        skeleton = KimiK3ForConditionalGeneration(dense_config, dtype=torch.float32, mxfp8_activations=False)
    weights = random_weights(skeleton, spec.seed)
    heads = dense_config.kda.num_heads
    for name, t in weights.items():
        if name.endswith("A_log"):
            t[heads:] = 0.0  # K3 zero-pads A_log to a multiple of 128 (model-spec §3.3)
    if spec.expert_format != "dense":
        weights, _ = quantize_expert_tensors(weights)
    if spec.expert_format == "gpt-oss":
        weights = to_gpt_oss_layout(weights)
    if vision:
        attach_tiny_vision(raw, weights, Tokenizer.from_pretrained(out), spec.hidden, vision_spec)
    save_weights(weights, out, spec.shard_bytes)
    write_metadata(out, raw, special_ids, spec)  # stops on <|end_of_msg|> (the config eos) and [EOS]
    return out
