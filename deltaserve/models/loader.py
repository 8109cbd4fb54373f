"""Build a model from a checkpoint directory: config, model class, safetensors weights streamed shard by shard."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.models.protocol import Model
from deltaserve.models.registry import model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, duplicated or mis-shaped; the message names it."""


def checkpoint_shards(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards listed by the index, or the single file."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightLoadError(f"{index} has no weight_map object")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise WeightLoadError(f"shard {shard} listed in {index} does not exist")
        return [path / s for s in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if found:
        return [path / f for f in found]
    raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {path}")


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, the tensor's lazy slice reader) one shard at a time, logging progress per shard. Index the reader
    (``reader[:]``, ``reader[a:b]``) to read the tensor or part of it from the file."""
    shards = checkpoint_shards(path)
    start = time.perf_counter()
    for n, shard in enumerate(shards, 1):
        size_mb = shard.stat().st_size / 2**20
        logger.info("loading shard %d/%d %s (%.1f MiB)", n, len(shards), shard.name, size_mb)
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
    logger.info("loaded %d shard(s) in %.1f s", len(shards), time.perf_counter() - start)


def load_weights(model: Model, path: Path) -> None:
    """Copy every checkpoint tensor into the model; each target must be filled exactly once. A `Shard` target reads
    only its slice of the checkpoint tensor (a tensor-parallel rank reads only what it holds); a None target is a
    tensor another rank holds, not read at all."""
    targets = model.checkpoint_tensors()
    seen: set[str] = set()
    for raw_name, reader in iter_checkpoint(path):
        name = model.canonical_name(raw_name)  # None: a tensor the model skips (e.g. K3's vision tower)
        if name is None:
            continue
        if name not in targets:
            raise WeightLoadError(f"unexpected tensor {raw_name!r} in checkpoint {path}")
        target = targets[name]
        if name in seen:
            raise WeightLoadError(f"tensor {raw_name!r} appears twice in checkpoint {path} (also as an alias)")
        if target is None:  # another rank's tensor (an expert-parallel partition): not read
            seen.add(name)
            continue
        shape = target.full_shape() if isinstance(target, Shard) else tuple(target.shape)
        if tuple(reader.get_shape()) != shape:
            raise WeightLoadError(f"tensor {raw_name!r} has shape {list(reader.get_shape())}, expected {list(shape)}")
        dest = target.target if isinstance(target, Shard) else target
        if _is_float(reader.get_dtype()) != dest.dtype.is_floating_point:
            # Packed MXFP4 codes and E8M0 scales are uint8: a float there (or the reverse) is a different format.
            raise WeightLoadError(
                f"tensor {raw_name!r} has dtype {_dtype_name(reader.get_dtype())}, expected {dest.dtype}")
        tensor = reader[target.index()] if isinstance(target, Shard) else reader[:]
        with torch.no_grad():
            dest.copy_(tensor)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise WeightLoadError(f"checkpoint {path} is missing tensor(s) {missing[:10]}{more}")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _dtype_name(safetensors_dtype: str) -> str:
    """A safetensors dtype name ('F32', 'U8', ...) as torch spells it ('torch.float32'), for error messages."""
    return str(_DTYPES.get(safetensors_dtype, safetensors_dtype))


def _is_float(safetensors_dtype: str) -> bool:
    """Whether a safetensors dtype name ('F32', 'BF16', 'U8', 'F8_E4M3', ...) is a floating-point format."""
    return safetensors_dtype.startswith(("F", "BF"))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", *,
               tp: ParallelGroup = SINGLE, expert_parallel: bool = False, eplb: EPLBSettings | None = None,
               replicas: ReplicaExperts | None = None) -> Model:
    """Config -> model class -> weights, in `dtype` (gate/router/decay parameters stay fp32). With `tp` of several
    ranks, this rank's shard of the model (`expert_parallel`: whole routed experts partitioned over the ranks,
    `eplb`: with load-balanced redundant copies, `replicas`: over every rank of several data-parallel replicas)."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    with torch.device(device):
        model = model_class(config)(config, dtype=dtype, tp=tp, expert_parallel=expert_parallel, eplb=eplb,
                                    replicas=replicas)
    load_weights(model, path)
    return model.eval()
