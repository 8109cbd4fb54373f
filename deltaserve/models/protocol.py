"""`Model`: what the runner, the loader and the benchmarks call on a loaded model, whatever its architecture.

`KimiLinearForCausalLM` and `KimiK3ForConditionalGeneration` are `nn.Module`s that satisfy it structurally; code
outside `models/` types a model as `Model`, not as a bare `nn.Module` (whose `__getattr__` makes every
architecture-specific method look like a tensor or a submodule).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, Self, runtime_checkable

import torch
from torch import nn

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.config import ModelConfig
from deltaserve.distributed import ParallelGroup, Shard
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.layers.forward_batch import ForwardBatch, LayerCache

CacheSpec = KVCacheSpec | StateCacheSpec
"""One layer's cache: MLA latent rows per token (`KVCacheSpec`) or a KDA state slot per sequence
(`StateCacheSpec`)."""


@runtime_checkable
class Model(Protocol):
    """A text model ready to run steps: one flattened forward over any mix of prefill and decode rows, the LM head
    on chosen rows, its per-layer cache specs and its checkpoint tensor names."""

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]) -> torch.Tensor:
        """Run `forward` (through `nn.Module.__call__`, so hooks apply)."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]) -> torch.Tensor:
        """input_ids: [T] -> final-normed hidden states [T, d]. Reads and writes `caches` (one per layer)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [n] -> token embeddings [n, d] (what `forward` starts from; a block drafter reads it too)."""

    def idle_experts(self) -> None:
        """Join every MoE layer's token exchange with no tokens (routed experts over data-parallel replicas)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, d] -> fp32 logits [n, vocab]."""

    def cache_specs(self) -> list[CacheSpec]:
        """One spec per decoder layer, in layer order."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        """Every checkpoint tensor name -> the tensor (or view) the loader copies it into, this rank's `Shard` of it
        (tensor parallelism), or None for a tensor another rank holds (expert parallelism)."""

    def canonical_name(self, name: str) -> str | None:
        """A checkpoint name -> the `checkpoint_tensors` name it loads into; None for a tensor to skip."""

    # The parts of `nn.Module` that callers use: the device and dtype (`parameters`), the roofline's byte count
    # (`modules`, `buffers`), inference mode after loading (`eval`).

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> Self: ...


class ModelClass(Protocol):
    """A model class as the registry returns it: built from the config, in a dtype, on the current default device."""

    def __call__(self, config: ModelConfig, dtype: torch.dtype = ..., *, tp: ParallelGroup = ...,
                 expert_parallel: bool = ..., eplb: EPLBSettings | None = ...,
                 replicas: ReplicaExperts | None = ...) -> Model: ...
