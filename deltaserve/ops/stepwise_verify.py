"""Speculative verification of a recurrent op, token by token through its decode op: the generic form of the `*_verify`
ops (`kda_verify`, `short_conv_verify`), used where no fused backend matches the decode backend in use.

A verify chunk is a sampled token and its proposals; its tokens must get exactly the numbers plain decoding would
give them, so every token runs the decode op on the state the previous one left, and the state after each of the
chunk's first tokens is saved to a scratch slot (the state to resume from when later proposals are rejected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def verify_stepwise(decode: Callable[[Tensor, Tensor], Tensor], num_rows: int, pool: Tensor, state_indices: Tensor,
                    cu_seqlens: Sequence[int], scratch_slots: Sequence[Sequence[int]]) -> Tensor:
    """Run verify chunks token by token with a decode op.

    Args:
        decode: ``decode(rows, slots)`` runs the decode op on the given rows (an int64 index into the chunks' rows)
            against those state slots of `pool`, updating them in place, and returns the rows' outputs.
        num_rows: rows of all chunks together (``cu_seqlens[-1]``).
        pool: the state pool `decode` updates (``[num_slots, ...]``); scratch states are copied within it.
        state_indices: ``[S]`` int64 state slot of each chunk (distinct).
        cu_seqlens: ``S + 1`` host offsets of the chunks' rows, from 0.
        scratch_slots: per chunk, the slots that receive its state after each of its first tokens (slot j after
            token j; at most one fewer than the chunk's tokens).

    Returns:
        The rows' outputs, ``[num_rows, ...]``; each chunk's slot ends with the state after its last token.
    """
    lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)]
    out: Tensor | None = None
    device = pool.device
    for t in range(max(lens, default=0)):
        seqs = [i for i, n in enumerate(lens) if n > t]
        rows = torch.tensor([cu_seqlens[i] + t for i in seqs], device=device)
        result = decode(rows, state_indices[torch.tensor(seqs, device=device)])
        if out is None:
            out = result.new_empty(num_rows, *result.shape[1:])
        out[rows] = result
        saved = [i for i in seqs if t < len(scratch_slots[i])]
        if saved:
            pool.index_copy_(0, torch.tensor([scratch_slots[i][t] for i in saved], device=device),
                             pool.index_select(0, state_indices[torch.tensor(saved, device=device)]))
    if out is None:
        raise ValueError("verify_stepwise: no verify rows")
    return out
