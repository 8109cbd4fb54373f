"""CPU backend of the recurrent KDA decode (spec §3.5): the reference's update rearranged so that each sequence's
state is read by one batched product and then updated by two in-place passes, where the reference makes six passes
over it (decay, read for the delta, outer-product temporary, add, read for the output).

With ``D = Diag(exp(g))`` (decay of the key rows): ``S' = D S + k delta^T`` with ``delta = beta (v - k^T D S)``, so
``q^T S' = (q exp(g))^T S + (q . k) delta``: both reads of the decayed state are one product of
``[q exp(g) ; k exp(g)]`` with the old state. Same numbers up to float rounding (the fp32 tolerance of
`deltaserve/ops/README.md`). At 32 sequences of the ~260M benchmark checkpoint (8 heads of 128 x 128) a call took
2.5 ms against the reference's 5.2 ms (one thread).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaserve.ops.kda import ref
from deltaserve.ops.kda.cpu import supports as supports  # the prefill backend's conditions: CPU, fp32 pool


def kda_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
               state_indices: Tensor | slice) -> Tensor:
    """Same contract as `ref.kda_decode` (rows update their slots of the fp32 pool in place; a slice of consecutive
    slots is updated where it lies) for the calls `supports` accepts."""
    qn, kn = ref._qk_norm(q, k, torch.float32)
    n, h, dk = kn.shape
    dv = v.shape[-1]
    if isinstance(state_indices, slice):
        idx = None
        states = state_pool[state_indices]  # a view: updated in place below
    else:
        idx = state_indices.to(device=state_pool.device, dtype=torch.long)
        states = state_pool.index_select(0, idx)
    flat = states.view(n * h, dk, dv)
    decay = g.float().exp()  # [N, H, K]
    reads = torch.stack((qn * decay, kn * decay), dim=-2).view(n * h, 2, dk) @ flat  # [N*H, 2, V]: one pass
    qs, ks = reads.view(n, h, 2, dv).unbind(2)
    delta = beta.float().unsqueeze(-1) * (v.float() - ks)  # [N, H, V]
    out = torch.addcmul(qs, (qn * kn).sum(-1, keepdim=True), delta)
    flat.mul_(decay.view(n * h, dk, 1)).baddbmm_(kn.reshape(n * h, dk, 1), delta.view(n * h, 1, dv))
    if idx is not None:
        state_pool.index_copy_(0, idx, states)
    return out.to(q.dtype)
