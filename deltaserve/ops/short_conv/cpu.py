"""CPU backend of the causal short convolution: the packed batch convolved as one stream with a few shifted
multiply-adds (the rows that read a sequence's start window are redone from that window), no per-tap gathers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.short_conv import ref


def supports(x: Tensor, weight: Tensor, *args: object, **kwargs: object) -> bool:
    """CPU tensors with fp32 or bf16 inputs and weight (anything else goes to the reference)."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and weight.dtype in _DTYPES


_DTYPES = (torch.float32, torch.bfloat16)


def _activate_(out: Tensor, activation: str | None) -> Tensor:
    """The reference's activation, in place on a buffer this module owns (no second [T, C] allocation)."""
    if activation in ("silu", "swish"):
        return F.silu(out, inplace=True)
    return ref._activate(out, activation)  # None, or the reference's error for an unknown name


def _stream_rows(windows: Tensor, x: Tensor, cu: Tensor, seq: Tensor, m: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows of the extended streams ``[window_i; tokens_i]`` at positions ``m`` of sequences ``seq`` (same shape),
    in ``dtype``: window entries for ``m < W-1``, else tokens. ``windows``: ``[N, W-1, C]`` (time first)."""
    state_len = windows.shape[1]
    in_window = m < state_len
    from_window = windows[seq, m.clamp(max=state_len - 1)].to(dtype)
    from_x = x[(cu[seq] + m - state_len).clamp(0, x.shape[0] - 1)].to(dtype)
    return torch.where(in_window.unsqueeze(-1), from_window, from_x)


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
    """Same contract as :func:`deltaserve.ops.short_conv.ref.short_conv_prefill` (in-place pool and checkpoint
    writes, packed varlen batch). The multiply-adds are fused (``addcmul_``, FMA on AVX CPUs), so outputs may differ
    from the reference in the last bit; the windows written to the pool are exact copies."""
    num_tokens, width = x.shape[0], weight.shape[-1]
    state_len = width - 1
    if num_tokens == 0 or state_len == 0:
        return ref.short_conv_prefill(x, weight, conv_state_pool, state_indices, cu_seqlens, activation,
                                      checkpoint_positions, checkpoint_slots)
    cu_host = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    seqs, positions, ckpt_slots = ref._checkpoints(checkpoint_positions, checkpoint_slots, cu_host)
    device, num_seqs = x.device, len(cu_host) - 1
    cu = torch.tensor(cu_host, dtype=torch.long, device=device)
    slots = state_indices.to(device=device, dtype=torch.long)
    windows = conv_state_pool.index_select(0, slots).transpose(1, 2)  # [N, W-1, C]

    # The conv as in the reference: inputs cast to weight.dtype, products and sums in at least fp32, oldest tap
    # first. Every row reads the rows before it in the packed stream; rows within W-1 of a sequence start, which
    # read that sequence's window instead, are recomputed below.
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.to(acc_dtype).t().contiguous()  # [W, C]: contiguous rows broadcast fast
    xs = x.to(weight.dtype).to(acc_dtype)  # no copy for fp32 in, fp32 weight
    out = torch.empty(num_tokens, x.shape[1], dtype=acc_dtype, device=device)
    if num_tokens > state_len:
        body = out[state_len:]
        torch.mul(xs[: num_tokens - state_len], w[0], out=body)
        for j in range(1, width):
            body.addcmul_(xs[j : num_tokens - state_len + j], w[j])
    head = [(i, p) for i in range(num_seqs) for p in range(min(state_len, cu_host[i + 1] - cu_host[i]))]
    if head:
        seq_t, pos_t = torch.tensor(head, dtype=torch.long, device=device).unbind(1)
        taps = _stream_rows(windows, x, cu, seq_t[:, None], pos_t[:, None] + torch.arange(width, device=device),
                            weight.dtype).to(acc_dtype)  # [n, W, C]
        fixed = taps[:, 0] * w[0]
        for j in range(1, width):
            fixed.addcmul_(taps[:, j], w[j])
        out.index_copy_(0, cu[seq_t] + pos_t, fixed)
    out = _activate_(out.to(weight.dtype), activation)

    # Windows after the last token (and at the checkpoints): extended positions p .. p + W-2, in the pool's dtype.
    window_pos = torch.arange(state_len, device=device)
    lengths = cu[1:] - cu[:-1]
    new = _stream_rows(windows, x, cu, torch.arange(num_seqs, device=device)[:, None], lengths[:, None] + window_pos,
                       conv_state_pool.dtype)  # [N, W-1, C]
    conv_state_pool.index_copy_(0, slots, new.transpose(1, 2).contiguous())
    if positions:
        seq_t, pos_t = (torch.tensor(v, dtype=torch.long, device=device) for v in (seqs, positions))
        rows = _stream_rows(windows, x, cu, seq_t[:, None], pos_t[:, None] + window_pos, conv_state_pool.dtype)
        conv_state_pool.index_copy_(0, torch.tensor(ckpt_slots, dtype=torch.long, device=device),
                                    rows.transpose(1, 2).contiguous())
    return out.to(x.dtype)


def short_conv_decode(
    x: Tensor,
    weight: Tensor,
    conv_state_pool: Tensor,
    state_indices: Tensor | slice,
    activation: str | None = "silu",
) -> Tensor:
    """Same contract as :func:`deltaserve.ops.short_conv.ref.short_conv_decode`, with the multiply-adds fused as in
    this module's prefill. The windows are read once into a time-first copy, so every tap is a contiguous row (the
    pool is channels first: its taps are stride-(W-1) columns, slow to read op by op), and shifted in place."""
    if isinstance(state_indices, slice):
        windows = conv_state_pool[state_indices]  # a view: shifted in place below
    else:
        slots = state_indices.to(device=conv_state_pool.device, dtype=torch.long)
        windows = conv_state_pool.index_select(0, slots)  # [N, C, W-1], written back below
    old = windows.transpose(1, 2).contiguous()  # [N, W-1, C] in the pool's dtype
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    w = weight.to(acc_dtype).t().contiguous()  # [W, C]: contiguous rows broadcast fast
    # Taps oldest first as in the reference: window entries from the pool, the new input cast straight from x.
    taps = [old[:, j] for j in range(old.shape[1])] + [x]
    out = taps[0].to(weight.dtype).to(acc_dtype) * w[0]
    for j in range(1, len(taps)):
        out.addcmul_(taps[j].to(weight.dtype).to(acc_dtype), w[j])
    out = _activate_(out.to(weight.dtype), activation)
    if old.shape[1]:
        windows[..., :-1] = old[:, 1:].transpose(1, 2)
        windows[..., -1] = x  # cast to the pool's dtype
    if not isinstance(state_indices, slice):
        conv_state_pool.index_copy_(0, slots, windows)
    return out.to(x.dtype)
