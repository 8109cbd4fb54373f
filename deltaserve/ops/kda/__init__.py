"""KDA ops (model-spec §3): the only names layers call, dispatched through `deltaserve.ops.dispatch`. CPU prefills
with fp32 / bf16 activations take the factorised chunked backend (`cpu.py`), CPU decodes the one-read update
(`cpu_decode.py`), CUDA decodes a Triton kernel (`triton_decode.py`); everything else runs the pure-PyTorch
reference."""

from typing import Any

import torch
from torch import Tensor

from deltaserve.ops import dispatch, triton_backend
from deltaserve.ops.kda import cpu, cpu_decode, ref


def _triton_decode_supports(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                            *args: Any, **kwargs: Any) -> bool:
    """Activations where the Triton kernels run and an fp32 state pool on the same device (asked without importing
    triton)."""
    return (triton_backend.runs_on(q) and state_pool.dtype == torch.float32 and state_pool.device == q.device
            and state_pool.stride(-1) == 1)


kda_gate = dispatch.op("kda_gate", ref.kda_gate)
kda_prefill = dispatch.op("kda_prefill", ref.kda_prefill)
kda_decode = dispatch.op("kda_decode", ref.kda_decode)
dispatch.register("kda_prefill", dispatch.Backend("cpu", cpu.kda_prefill, supports=cpu.supports))
dispatch.register("kda_decode", dispatch.Backend("cpu", cpu_decode.kda_decode, supports=cpu_decode.supports))
dispatch.register(  # after the CPU backend (CPU tensors go there first); by name: triton imported only if available
    "kda_decode", dispatch.Backend("triton", "deltaserve.ops.kda.triton_decode:kda_decode_triton",
                                   available=triton_backend.available, supports=_triton_decode_supports,
                                   forced_only=triton_backend.forced_only))

__all__ = ["kda_decode", "kda_gate", "kda_prefill"]
