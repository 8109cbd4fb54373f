"""KDA ops (model-spec §3): the only names layers call, dispatched through `deltaserve.ops.dispatch`. CPU prefills
with fp32 / bf16 activations take the factorised chunked backend (`cpu.py`), CUDA prefills fla-core's `chunk_kda`
(`fla_prefill.py`), CPU decodes the C kernel (`native.c`)
where it builds, else the one-read update (`cpu_decode.py`), CUDA decodes a Triton kernel (`triton_decode.py`);
everything else runs the pure-PyTorch reference. `kda_verify` (speculative verify chunks) follows the decode
backend, so that a verified token gets the numbers plain decoding gives it."""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from deltaserve.ops import dispatch, triton_backend
from deltaserve.ops.kda import cpu, cpu_decode, fla_prefill, native, ref
from deltaserve.ops.stepwise_verify import verify_stepwise


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
dispatch.register(  # after the CPU backend; fla itself is imported by the first call
    "kda_prefill", dispatch.Backend("fla", fla_prefill.kda_prefill_fla,
                                    available=fla_prefill.available, supports=fla_prefill.supports,
                                    forced_only=triton_backend.forced_only))
dispatch.register("kda_decode", dispatch.Backend("native", native.kda_decode, available=native.available,
                                                 supports=native.supports))
dispatch.register("kda_decode", dispatch.Backend("cpu", cpu_decode.kda_decode, supports=cpu_decode.supports))
dispatch.register(  # after the CPU backend (CPU tensors go there first); by name: triton imported only if available
    "kda_decode", dispatch.Backend("triton", "deltaserve.ops.kda.triton_decode:kda_decode_triton",
                                   available=triton_backend.available, supports=_triton_decode_supports,
                                   forced_only=triton_backend.forced_only))



def kda_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
               cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Speculative verify chunks in the recurrent form: each token exactly as `kda_decode` would run it after the
    chunk's previous tokens (the backend `kda_decode` picks for these arguments, fused where one exists).

    Args:
        q, k, v, g, beta: the chunks' rows, as for `kda_decode` (``[R, H, K]``, ..., ``[R, H]``).
        state_pool: ``[num_slots, H, K, V]`` fp32; each chunk's slot is updated in place to the state after its last
            token.
        state_indices: ``[S]`` int64 distinct slot of each chunk.
        cu_seqlens: ``S + 1`` host offsets of the chunks' rows, from 0.
        scratch_slots: per chunk, slots that receive its state after each of its first tokens (slot j after token j).

    Returns:
        ``[R, H, V]`` in q's dtype.
    """
    backend = dispatch.get("kda_decode").select(q, k, v, g, beta, state_pool, state_indices)
    if backend == "native":
        return native.kda_verify(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, scratch_slots)
    if backend == "cpu":
        return cpu_decode.kda_verify(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, scratch_slots)
    return verify_stepwise(lambda rows, slots: kda_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], state_pool,
                                                          slots),
                           q.shape[0], state_pool, state_indices, cu_seqlens, scratch_slots)


__all__ = ["kda_decode", "kda_gate", "kda_prefill", "kda_verify"]
