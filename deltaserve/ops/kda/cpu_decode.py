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

from collections.abc import Sequence

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


def kda_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
               cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Same contract as `deltaserve.ops.kda.kda_verify`, bit for bit what `kda_decode` gives token by token.

    Each token's update is `kda_decode`'s arithmetic on the same shapes, but what does not depend on the state (the
    q/k norms, the decayed q and k, q . k) is computed for every row at once, the states are gathered once and
    stepped in place, and the chunks are taken longest first so that the chunks still running at token t are a
    prefix: a verify step costs ~10 ops per token where calling `kda_decode` per token cost ~40 and index building."""
    num_seqs = len(cu_seqlens) - 1
    lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(num_seqs)]
    order = sorted(range(num_seqs), key=lambda i: -lens[i])
    # Rows time-major, chunks longest first within each token: token t's rows are one contiguous block.
    perm = [cu_seqlens[i] + t for t in range(max(lens, default=0)) for i in order if lens[i] > t]
    active = [sum(1 for i in order if lens[i] > t) for t in range(max(lens, default=0))]
    device = state_pool.device
    perm_t = torch.tensor(perm, device=device)
    qn, kn = ref._qk_norm(q, k, torch.float32)  # per row: the same numbers as per-token calls
    decay = g.float().exp()
    n_all, h, dk = kn.shape
    dv = v.shape[-1]
    stacked = torch.stack((qn * decay, kn * decay), dim=-2).index_select(0, perm_t)  # [R, H, 2, K]
    qk = (qn * kn).sum(-1, keepdim=True).index_select(0, perm_t)
    kn_p, decay_p = kn.index_select(0, perm_t), decay.index_select(0, perm_t)
    beta_p, v_p = beta.float().unsqueeze(-1).index_select(0, perm_t), v.float().index_select(0, perm_t)
    slots = state_indices.to(device=device, dtype=torch.long)[torch.tensor(order, device=device)]
    states = state_pool.index_select(0, slots)  # [S, H, K, V] in `order`
    out = torch.empty(n_all, h, dv, dtype=torch.float32, device=device)
    start = 0
    for t, n in enumerate(active):
        rows = slice(start, start + n)
        start += n
        flat = states[:n].view(n * h, dk, dv)
        reads = stacked[rows].reshape(n * h, 2, dk) @ flat
        qs, ks = reads.view(n, h, 2, dv).unbind(2)
        delta = beta_p[rows] * (v_p[rows] - ks)
        torch.addcmul(qs, qk[rows], delta, out=out[rows])
        flat.mul_(decay_p[rows].view(n * h, dk, 1)).baddbmm_(kn_p[rows].reshape(n * h, dk, 1),
                                                             delta.view(n * h, 1, dv))
        saved = [j for j in range(n) if t < len(scratch_slots[order[j]])]
        if saved:
            state_pool.index_copy_(0, torch.tensor([scratch_slots[order[j]][t] for j in saved], device=device),
                                   states[:n] if len(saved) == n else states[torch.tensor(saved, device=device)])
    state_pool.index_copy_(0, slots, states)
    result = torch.empty_like(out)
    result.index_copy_(0, perm_t, out)
    return result.to(q.dtype)
