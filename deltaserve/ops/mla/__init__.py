"""Paged latent attention (MLA, no positional encoding): the only entry points layers call, dispatched. `mla_prefill`
(`sdpa.py`) and `mla_decode` (`cpu_decode.py`) have CPU flash-attention backends for fp32 and bf16; on CUDA
`mla_prefill` runs PyTorch's fused attention on expanded keys (`expanded_sdpa.py`) and `mla_decode` a Triton kernel
(`triton_decode.py`); everything else runs the reference."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from deltaserve.ops import dispatch, triton_backend
from deltaserve.ops.mla import cpu_decode, expanded_sdpa, ref, sdpa


def _triton_decode_supports(q: Tensor, kv_cache: Tensor, *args: Any, **kwargs: Any) -> bool:
    """Queries and cache where the Triton kernels run, in one dtype (asked without importing triton)."""
    return triton_backend.runs_on(q) and kv_cache.dtype == q.dtype


mla_write_cache = dispatch.op("mla_write_cache", ref.mla_write_cache)
mla_prefill = dispatch.op("mla_prefill", ref.mla_prefill)
mla_decode = dispatch.op("mla_decode", ref.mla_decode)
dispatch.register(
    "mla_prefill",
    dispatch.Backend("sdpa", sdpa.mla_prefill_sdpa, available=sdpa.available, supports=sdpa.supports),
)
dispatch.register(  # CUDA only: PyTorch's fused attention per sequence
    "mla_prefill",
    dispatch.Backend("expanded_sdpa", expanded_sdpa.mla_prefill_expanded, supports=expanded_sdpa.supports),
)
dispatch.register(
    "mla_decode",
    dispatch.Backend("cpu", cpu_decode.mla_decode_cpu, available=sdpa.available, supports=cpu_decode.supports),
)
dispatch.register(  # after the CPU backend (CPU tensors go there first); by name: triton imported only if available
    "mla_decode",
    dispatch.Backend("triton", "deltaserve.ops.mla.triton_decode:mla_decode_triton",
                     available=triton_backend.available, supports=_triton_decode_supports,
                     forced_only=triton_backend.forced_only),
)

__all__ = ["mla_decode", "mla_prefill", "mla_write_cache"]
