"""MXFP4 checkpoints (model-spec §10): quantise a K3 checkpoint's routed experts (`deltaserve quantize`), and the
compressed-tensors and gpt-oss on-disk layouts."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.config import ModelConfig
from deltaserve.config.model import K3_ARCHITECTURE
from deltaserve.config.quantization import MXFP4_FORMAT
from deltaserve.models.loader import INDEX_FILE, checkpoint_shards
from deltaserve.ops.mxfp4 import BLOCK_SIZE, mxfp4_quantize

logger = logging.getLogger(__name__)

# A routed-expert projection: `[...block_sparse_moe.]experts.{e}.w{1,2,3}.weight` (w1 gate, w3 up, w2 down).
_EXPERT_WEIGHT = re.compile(r"^(?P<base>(?:.*\.)?experts\.\d+\.w[123])\.weight$")
_EXPERT_PACKED = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<w>w[123])\.weight_(?P<kind>packed|scale)$")


def compressed_tensors_config() -> dict[str, Any]:
    """K3's `quantization_config`: compressed-tensors `mxfp4-pack-quantized`, routed experts only (spec §1.3)."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": MXFP4_FORMAT,
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK_SIZE,
                            "symmetric": True, "dynamic": False},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["re:.*shared_experts.*"],
        "kv_cache_scheme": None,
    }


def gpt_oss_config() -> dict[str, Any]:
    """A gpt-oss style `quantization_config` (`quant_method: mxfp4`, stacked `*_blocks` / `*_scales` experts)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": ["shared_experts"]}


def quantize_expert_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Replace every `...experts.{e}.w{1,2,3}.weight` with MXFP4 `weight_packed` and `weight_scale` (uint8).

    Returns the new dict (other tensors unchanged, order kept) and the number of matrices quantised.
    """
    out: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in tensors.items():
        match = _EXPERT_WEIGHT.match(name)
        if match is None:
            out[name] = tensor
            continue
        q = mxfp4_quantize(tensor)
        out[f"{match['base']}.weight_packed"] = q.packed
        out[f"{match['base']}.weight_scale"] = q.scale
        count += 1
    return out, count


def to_gpt_oss_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors expert tensors -> gpt-oss's stacked layout (spec §10.3), per MoE layer:
    `experts.gate_up_proj_blocks [E, 2I, in/32, 16]` (gate and up rows interleaved), `gate_up_proj_scales`,
    `experts.down_proj_blocks [E, out, I/32, 16]`, `down_proj_scales`. The bytes are the same; only the grouping
    differs. Other tensors are kept."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _EXPERT_PACKED.match(name)
        if match is None:
            out[name] = tensor
        else:
            layers.setdefault(match["prefix"], {})[(int(match["e"]), match["w"], match["kind"])] = tensor
    for prefix, parts in layers.items():
        num_experts = 1 + max(e for e, _, _ in parts)
        for kind, suffix in (("packed", "blocks"), ("scale", "scales")):
            gate_up = torch.stack([torch.stack((parts[(e, "w1", kind)], parts[(e, "w3", kind)]), dim=1).flatten(0, 1)
                                   for e in range(num_experts)])
            down = torch.stack([parts[(e, "w2", kind)] for e in range(num_experts)])
            if kind == "packed":
                gate_up, down = (t.unflatten(-1, (-1, BLOCK_SIZE // 2)) for t in (gate_up, down))
            out[f"{prefix}gate_up_proj_{suffix}"] = gate_up.contiguous()
            out[f"{prefix}down_proj_{suffix}"] = down.contiguous()
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write to `dst` a copy of the K3 checkpoint `src` with its routed experts in MXFP4 (compressed-tensors
    `mxfp4-pack-quantized`, K3's own layout), shard by shard; other tensors and files are copied unchanged."""
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    if config.architecture != K3_ARCHITECTURE:
        raise ValueError(f"quantize converts {K3_ARCHITECTURE} checkpoints; {src} is {config.architecture}")
    if config.quantization is not None:
        raise ValueError(f"{src} is already quantised (text_config.quantization_config is set)")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError("the output directory must differ from the input")
    dst.mkdir(parents=True, exist_ok=True)
    shards = checkpoint_shards(src)
    weight_map: dict[str, str] = {}
    total_bytes = num_quantised = 0
    for n, shard in enumerate(shards, 1):
        with safe_open(shard, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            metadata = f.metadata() or {"format": "pt"}
        tensors, count = quantize_expert_tensors(tensors)
        save_file(tensors, str(dst / shard.name), metadata=metadata)
        weight_map.update({name: shard.name for name in tensors})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        num_quantised += count
        logger.info("quantised shard %d/%d %s: %d expert matrices", n, len(shards), shard.name, count)
    if num_quantised == 0:
        raise ValueError(f"{src} has no routed-expert weights (...experts.{{e}}.w1.weight)")
    if (src / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    raw["text_config"]["quantization_config"] = compressed_tensors_config()
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for path in src.iterdir():  # tokenizer, generation config, ...
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, dst / path.name)
    return dst
