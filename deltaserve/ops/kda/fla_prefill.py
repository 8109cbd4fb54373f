"""KDA prefill through fla-core's Triton `chunk_kda`: the `fla` backend of `kda_prefill` (same contract as
`ref.kda_prefill`), for CUDA (and, forced, Triton's interpreter in fp32 on a CPU, in the parity tests).

Mapping of the contract onto `chunk_kda`: raw q and k with `use_qk_l2norm_in_kernel` and scale ``K**-0.5``; the
precomputed log-decay `g` (`kda_gate`, K3's lower bound included) and sigmoid-ed `beta` as they are; the state pool's
layout is fla's default (K-first, ``[H, K, V]`` per slot, `state_v_first=False`): the sequences' slots are gathered
into `initial_state` and the fp32 final states scattered back; packed varlen rows through `cu_seqlens` (host offsets
also passed as `cu_seqlens_cpu`, so planning reads nothing back from the device).

Prefix-cache checkpoints at arbitrary positions (`chunk_kda`'s intermediate states exist only at its 64-token chunk
ends, and in bf16): each sequence is cut at its checkpoint positions into segments, and the call runs in rounds,
round r processing the r-th segment of every sequence that has one, from the state the round before left; the state
after a segment that ends at a checkpoint is copied to its slot. A prefill with no checkpoint is one call; a prompt
with its usual checkpoint at the last full block is two.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from deltaserve.ops import triton_backend

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
"""Largest key / value head size `chunk_kda` takes."""


@functools.cache
def available() -> bool:
    """fla-core is installed (the `kernels` extra) and Triton kernels run here. Where Triton runs but fla-core is
    missing, says so once: KDA prefills then take the reference."""
    if not triton_backend.available():
        return False
    try:
        found = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):  # hidden (`sys.modules["fla"] = None`) or broken
        found = False
    if not found:
        logger.info("fla-core is not installed: KDA prefill runs the reference (pip install 'deltaserve[kernels]')")
    return found


def supports(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, *args: object,
             **kwargs: object) -> bool:
    """Activations where Triton kernels run, an fp32 state pool on their device, one value head per key head (no
    grouped values), head sizes `chunk_kda` takes. Asked without importing fla."""
    return (triton_backend.runs_on(q) and state_pool.dtype == torch.float32 and state_pool.device == q.device
            and v.shape[1] == q.shape[1] and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM)


def kda_prefill_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
    checkpoint_slots: Sequence[Sequence[int]] | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """`ref.kda_prefill`'s contract through `fla.ops.kda.chunk_kda` (its own chunk size, 64: `chunk_size` is the
    reference's and does not change results beyond rounding)."""
    from fla.ops.kda import chunk_kda

    from deltaserve.ops.kda.ref import _check_checkpoints

    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    if checkpoint_positions is not None or checkpoint_slots is not None:
        _check_checkpoints(checkpoint_positions, checkpoint_slots, cu)  # the reference's errors, before any work
    num_seqs, scale = len(cu) - 1, q.shape[-1] ** -0.5
    out = torch.empty(q.shape[0], *v.shape[1:], dtype=q.dtype, device=q.device)
    ckpts = checkpoint_positions or [()] * num_seqs
    ckpt_slots = checkpoint_slots or [()] * num_seqs
    # Per sequence its segment bounds: 0, each checkpoint below its length, its length.
    bounds = [[0, *(p for p in ckpts[i] if 0 < p < cu[i + 1] - cu[i]), cu[i + 1] - cu[i]] for i in range(num_seqs)]
    live = [i for i in range(num_seqs) if cu[i + 1] > cu[i]]
    if not live:
        return out
    slots = state_indices.to(device=q.device, dtype=torch.long)
    states = state_pool.index_select(0, slots)  # [N, H, K, V] fp32: each sequence's running state
    # One call for the whole batch when no sequence is cut and none is empty (no gather of rows).
    whole = len(live) == num_seqs and all(len(b) == 2 for b in bounds)
    for r in range(max(len(bounds[i]) - 1 for i in live)):
        seqs = [i for i in live if len(bounds[i]) - 1 > r]
        spans = [(cu[i] + bounds[i][r], cu[i] + bounds[i][r + 1]) for i in seqs]
        rows: Tensor | None = None
        offsets = cu
        if not whole:
            rows = torch.cat([torch.arange(a, b, device=q.device) for a, b in spans])
            offsets = [0]
            for a, b in spans:
                offsets.append(offsets[-1] + b - a)
        picked = [x if rows is None else x.index_select(0, rows) for x in (q, k, v, g, beta)]
        seq_idx = torch.tensor(seqs, device=q.device)
        cu_host = torch.tensor(offsets, dtype=torch.long)
        o, final = chunk_kda(*(x[None] for x in picked), scale=scale, initial_state=states.index_select(0, seq_idx),
                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                             cu_seqlens=cu_host.to(q.device), cu_seqlens_cpu=cu_host)
        if rows is None:
            out.copy_(o[0].to(out.dtype))
        else:
            out.index_copy_(0, rows, o[0].to(out.dtype))
        states.index_copy_(0, seq_idx, final.to(states.dtype))
        for n, i in enumerate(seqs):  # a segment ending at a checkpoint: its state goes to the checkpoint's slot
            end = bounds[i][r + 1]
            for p, slot in zip(ckpts[i], ckpt_slots[i], strict=True):
                if p == end:
                    state_pool[slot].copy_(final[n])
    state_pool.index_copy_(0, slots[torch.tensor(live, device=q.device)],
                           states.index_select(0, torch.tensor(live, device=q.device)))
    return out
