"""Tiny random checkpoints for CPU tests (`deltaserve make-tiny [--arch]`), loadable by deltaserve and transformers:
`write_tiny_checkpoint` writes a Kimi Linear one here, a K3 one through `tiny_k3.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.models.kimi_linear import KimiLinearForCausalLM
from deltaserve.models.tiny_checkpoint import random_weights, save_weights, tiny_config_dict, write_metadata
from deltaserve.models.tiny_k3 import write_tiny_k3_checkpoint
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.models.tiny_vision import attach_tiny_vision
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_SPEC", "TinySpec", "tiny_config_dict", "write_tiny_checkpoint", "write_tiny_kimi_linear_checkpoint"]

DEFAULT_SPEC = TinySpec()


def write_tiny_checkpoint(out_dir: str | Path, spec: TinySpec = DEFAULT_SPEC) -> Path:
    """Write config.json, generation_config.json, safetensors weights and a small BPE tokenizer to `out_dir`, for
    the architecture `spec.arch` names."""
    if spec.arch == "kimi_k3":
        return write_tiny_k3_checkpoint(out_dir, spec, vision=spec.vision)
    if spec.arch == "kimi_linear":
        return write_tiny_kimi_linear_checkpoint(out_dir, spec)
    raise ValueError(f"arch={spec.arch!r} must be 'kimi_linear' or 'kimi_k3'")


def write_tiny_kimi_linear_checkpoint(out_dir: str | Path, spec: TinySpec) -> Path:
    """Write a random Kimi Linear checkpoint; `spec.dense_name` picks the dense layers' tensor names; `spec.vision`
    adds a tiny vision tower (and the four media tokens last in the tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if spec.dense_name not in ("mlp", "block_sparse_moe"):
        raise ValueError(f"dense_name={spec.dense_name!r} must be 'mlp' or 'block_sparse_moe'")
    special_ids = write_tiny_tokenizer(out, spec.vocab, flavor="k2_vision" if spec.vision else "k2")
    raw = tiny_config_dict(spec, special_ids)
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        skeleton = KimiLinearForCausalLM(config, dtype=torch.float32)
    weights = random_weights(skeleton, spec.seed)
    if spec.dense_name == "block_sparse_moe":
        weights = {_to_block_sparse_name(k, config): v for k, v in weights.items()}
    if spec.vision:
        attach_tiny_vision(raw, weights, Tokenizer.from_pretrained(out), spec.hidden)
    save_weights(weights, out, spec.shard_bytes)
    write_metadata(out, raw, special_ids, spec)
    return out


def _to_block_sparse_name(name: str, config: ModelConfig) -> str:
    for i in range(config.first_k_dense_replace):
        prefix = f"model.layers.{i}.mlp."
        if name.startswith(prefix):
            return f"model.layers.{i}.block_sparse_moe." + name[len(prefix) :]
    return name
