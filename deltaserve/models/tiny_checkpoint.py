"""What every tiny random checkpoint writer shares (`tiny.py` for Kimi Linear, `tiny_k3.py` for K3): the Kimi Linear
config dict, random weights, the safetensors files and the metadata files.

Weights are drawn large (model-spec §13.2) so that logits are far from uniform and routing far from tied: a mistake
anywhere moves the argmax.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deltaserve.models.protocol import Model
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.text.tokenizer import Tokenizer


def tiny_config_dict(spec: TinySpec, special_ids: dict[str, int]) -> dict[str, Any]:
    """A config.json in Moonshot field names."""
    mla = sorted({n for n in range(4, spec.layers + 1, 4)} | {spec.layers})
    kda = [n for n in range(1, spec.layers + 1) if n not in mla]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.mla_heads,
        "num_key_value_heads": spec.mla_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": spec.kda_heads,
            "head_dim": spec.kda_head_dim,
            "short_conv_kernel_size": 4,
            "kda_layers": kda,
            "full_attn_layers": mla,
        },
        "num_experts": spec.experts,
        "num_experts_per_token": spec.top_k,
        "num_shared_experts": spec.shared_experts,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": spec.num_expert_group,
        "topk_group": spec.topk_group,
        "moe_renormalize": True,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "first_k_dense_replace": spec.first_k_dense,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "model_max_length": 4096,
        "bos_token_id": special_ids["bos_token_id"],
        "eos_token_id": special_ids["eos_token_id"],
        "pad_token_id": special_ids["pad_token_id"],
        "torch_dtype": "float32",
    }


def random_weights(model: Model, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors drawn per model-spec §13.2 (large matrices, perturbed norms, spread gates)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, target in model.checkpoint_tensors().items():
        assert isinstance(target, torch.Tensor), "a tiny checkpoint is drawn from a single-rank model"
        shape = tuple(target.shape)
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith(("dt_bias",)):
            t = torch.randn(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t = 0.2 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # every norm weight
            t = 1.0 + 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen) * 1.5 / math.sqrt(shape[-1])
        elif name.endswith("model.embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * 1.5 / math.sqrt(shape[-1])
        out[name] = t.contiguous()
    return out


def write_metadata(out: Path, raw: dict[str, Any], special_ids: dict[str, int], spec: TinySpec) -> None:
    """config.json, generation_config.json (stop on the config eos and [EOS], model-spec §11) and tiny_spec.json."""
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {
        "bos_token_id": special_ids["bos_token_id"],
        "eos_token_id": [special_ids["eos_token_id"], Tokenizer.from_pretrained(out).special_tokens["[EOS]"]],
        "pad_token_id": special_ids["pad_token_id"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")


def save_weights(weights: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    """One model.safetensors, or shards of about `shard_bytes` with a model.safetensors.index.json."""
    if shard_bytes <= 0:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
