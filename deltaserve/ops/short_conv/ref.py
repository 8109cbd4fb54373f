"""Reference depthwise causal short convolution with a conv-state pool (model-spec §3.1).

Pure PyTorch; the specification and test oracle for any fast backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def _activate(out: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")


def _checkpoints(positions: Sequence[Sequence[int]] | None, slots: Sequence[Sequence[int]] | None,
                 cu: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """The requested checkpoints flattened in sequence order: (sequence, position, slot) lists, validated."""
    if positions is None and slots is None:
        return [], [], []
    if positions is None or slots is None:
        raise ValueError("checkpoint_positions and checkpoint_slots go together")
    if len(positions) != len(cu) - 1 or len(slots) != len(cu) - 1:
        raise ValueError("checkpoint_positions and checkpoint_slots need one list per sequence")
    seqs: list[int] = []
    flat_pos: list[int] = []
    flat_slots: list[int] = []
    for i, (ps, ss) in enumerate(zip(positions, slots, strict=True)):
        if len(ps) != len(ss):
            raise ValueError(f"sequence {i}: {len(ps)} checkpoint positions but {len(ss)} checkpoint slots")
        if any(not 1 <= p <= cu[i + 1] - cu[i] for p in ps):
            raise ValueError("checkpoint positions must be within 1..len of their sequence")
        seqs += [i] * len(ps)
        flat_pos += ps
        flat_slots += ss
    return seqs, flat_pos, flat_slots


def short_conv_prefill(
    x: Tensor,
    weight: Tensor,
    conv_state_pool: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    activation: str | None = "silu",
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
    checkpoint_slots: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """Depthwise causal conv over a packed varlen batch, reading and updating a conv-state pool.

    ``out[t, c] = sum_j weight[c, j] * u[t - (W-1) + j, c]`` where ``u`` is sequence i's window followed by its tokens
    (tap ``W-1`` is the current token).

    Args:
        x: ``[T, C]`` pre-conv inputs; rows ``cu_seqlens[i]:cu_seqlens[i+1]`` belong to sequence i.
        weight: ``[C, W]`` depthwise kernel (``W`` = kernel width, no bias).
        conv_state_pool: ``[S, C, W-1]``; per slot the last ``W-1`` pre-conv inputs, oldest first (channels first,
            time last). A fresh sequence starts from a slot the caller has zeroed. **Updated in place**: the slot of
            sequence i receives the window after its last token (for a sequence shorter than ``W-1`` the older
            entries shift left, exactly as a token-by-token update). Stored in the pool's dtype.
        state_indices: ``[N]`` int slot per sequence; must be distinct. Other slots are not touched.
        cu_seqlens: ``[N+1]`` int cumulative sequence lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``;
            a host sequence or an int tensor (read back to the host, a sync on a GPU, only to check checkpoint
            positions). Zero-length sequences are allowed (their window is unchanged).
        activation: ``"silu"`` (default, the only one the model uses), ``"swish"`` (alias) or ``None``.
        checkpoint_positions: per sequence, positions ``1 <= p <= len_i`` (any order): the window after the first
            ``p`` tokens of that sequence is written **in place** to ``conv_state_pool[checkpoint_slots[i][n]]``
            (prefix-cache checkpoints, or the windows after each draft token of a speculative verification).
            None for none.
        checkpoint_slots: the slots those windows go to, aligned with ``checkpoint_positions``; distinct from each
            other and from ``state_indices``.

    Returns:
        ``[T, C]`` in ``x.dtype``. The conv is computed in ``weight.dtype`` (inputs are cast to it, as transformers
        does; products accumulate in at least fp32), the activation runs in ``weight.dtype``.
    """
    num_tokens = x.shape[0]
    width = weight.shape[-1]
    state_len = width - 1
    num_seqs = state_indices.shape[0]
    device = x.device
    if isinstance(cu_seqlens, Tensor):
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        cu_host = cu.tolist() if checkpoint_positions is not None or checkpoint_slots is not None else []
    else:
        cu_host = list(cu_seqlens)
        cu = torch.tensor(cu_host, dtype=torch.long, device=device)
    slots = state_indices.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]  # [N]

    windows = conv_state_pool.index_select(0, slots)  # [N, C, W-1]
    window_rows = windows.transpose(1, 2).reshape(num_seqs * state_len, weight.shape[0])  # [N*(W-1), C]
    # buf rows: the N windows of W-1 rows each (oldest first), then the T packed tokens; kept in the pool dtype
    # for the state write-back, while the conv reads the same rows cast to weight.dtype.
    buf = torch.cat([window_rows, x.to(conv_state_pool.dtype)])

    def ext_to_row(seq: Tensor, m: Tensor) -> Tensor:
        """Row of ``buf`` holding position ``m`` of sequence ``seq``'s extended stream [window; tokens]."""
        return torch.where(m < state_len, seq * state_len + m, num_seqs * state_len + cu[seq] + m - state_len)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths, output_size=num_tokens)
    pos_in_seq = torch.arange(num_tokens, device=device) - cu[seq_of_token]  # [T]
    taps = torch.arange(width, device=device)
    tap_rows = ext_to_row(seq_of_token[:, None], pos_in_seq[:, None] + taps)  # [T, W]

    conv_in = torch.cat([window_rows.to(weight.dtype), x.to(weight.dtype)])  # [N*(W-1) + T, C]
    # One row gather per tap (a loop over the W taps, not tokens): index_select is far faster on CPU than gathering
    # a [T, W, C] tensor with advanced indexing and reducing over a strided W axis.
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.to(acc_dtype)
    out = conv_in.index_select(0, tap_rows[:, 0]).to(acc_dtype) * w[:, 0]
    for j in range(1, width):
        out.add_(conv_in.index_select(0, tap_rows[:, j]).to(acc_dtype) * w[:, j])
    out = _activate(out.to(weight.dtype), activation)

    # New window of sequence i: extended positions L_i .. L_i + W-2.
    win_pos = lengths[:, None] + torch.arange(state_len, device=device)  # [N, W-1]
    new_windows = buf[ext_to_row(torch.arange(num_seqs, device=device)[:, None], win_pos)]  # [N, W-1, C]
    conv_state_pool.index_copy_(0, slots, new_windows.transpose(1, 2).contiguous())
    # Checkpoint windows: after p tokens of sequence i, its extended positions p .. p + W-2.
    seqs, positions, ckpt_slots = _checkpoints(checkpoint_positions, checkpoint_slots, cu_host)
    if positions:
        seq_t, pos_t = (torch.tensor(v, dtype=torch.long, device=device) for v in (seqs, positions))
        rows = ext_to_row(seq_t[:, None], pos_t[:, None] + torch.arange(state_len, device=device))  # [n, W-1]
        ckpt_idx = torch.tensor(ckpt_slots, dtype=torch.long, device=device)
        conv_state_pool.index_copy_(0, ckpt_idx, buf[rows].transpose(1, 2).contiguous())
    return out.to(x.dtype)


def short_conv_decode(
    x: Tensor,
    weight: Tensor,
    conv_state_pool: Tensor,
    state_indices: Tensor | slice,
    activation: str | None = "silu",
) -> Tensor:
    """One-token-per-sequence causal conv step against a conv-state pool.

    Args:
        x: ``[N, C]``; row i is the next pre-conv input of the sequence in slot ``state_indices[i]``.
        weight: ``[C, W]`` depthwise kernel.
        conv_state_pool: ``[S, C, W-1]`` window per slot, oldest first. **Updated in place**: the slot of row i
            drops its oldest entry and appends ``x[i]`` (in the pool's dtype).
        state_indices: ``[N]`` int, distinct slots, or a ``slice`` of N consecutive slots (no gather and scatter).
            Other slots are not touched.
        activation: ``"silu"`` (default), ``"swish"`` or ``None``.

    Returns:
        ``[N, C]`` in ``x.dtype``; same numerics as :func:`short_conv_prefill`.
    """
    if isinstance(state_indices, slice):
        windows = conv_state_pool[state_indices]  # a view: read below before it is overwritten
    else:
        slots = state_indices.to(device=conv_state_pool.device, dtype=torch.long)
        windows = conv_state_pool.index_select(0, slots)  # [N, C, W-1]
    # One multiply-add per tap, oldest first, as in the prefill: the same sums (bit for bit) as reducing a stacked
    # [N, C, W] tensor over W, without building it; a reduction over a last dim of 4 is slow on CPU.
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.to(acc_dtype)
    width = weight.shape[-1]
    taps = [windows[..., j] for j in range(width - 1)] + [x]
    out = taps[0].to(weight.dtype).to(acc_dtype) * w[:, 0]
    for j in range(1, width):
        out.add_(taps[j].to(weight.dtype).to(acc_dtype) * w[:, j])
    out = _activate(out.to(weight.dtype), activation)
    # The pool keeps its own precision (a narrower weight dtype must not round the stored inputs).
    new_windows = torch.cat([windows, x.to(conv_state_pool.dtype)[:, :, None]], dim=-1)[:, :, 1:]
    if isinstance(state_indices, slice):
        conv_state_pool[state_indices] = new_windows
    else:
        conv_state_pool.index_copy_(0, slots, new_windows)
    return out.to(x.dtype)
