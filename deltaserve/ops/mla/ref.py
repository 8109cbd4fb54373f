"""Reference paged MLA without positional encoding (model-spec §4): cache write, expanded prefill, latent decode.

Pure PyTorch; the specification and test oracle for any fast backend. The cache row of a token is ``[c ; kr]``. The
layer owns ``kv_b``: it passes its key and value halves to the prefill, and absorbs them around the decode (which is
pure latent attention, MQA over the cache rows).
"""

from __future__ import annotations

import torch
from torch import Tensor


def mla_write_cache(latent: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the latent rows of new tokens into the paged cache.

    Args:
        latent: ``[T, R+Dr]``, per token ``concat(c, kr)`` with ``c`` already RMS-normed.
        kv_cache: ``[num_blocks, block_size, R+Dr]``, contiguous. **Written in place** (cast to its dtype).
        slot_mapping: ``[T]`` int64, ``block_id * block_size + offset`` per token; distinct.
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping.to(device=flat.device, dtype=torch.long), latent.to(kv_cache.dtype))


def _gather_context(kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, num_positions: int) -> Tensor:
    """``[N, P, R+Dr]`` cache rows of positions ``0..P-1`` of each sequence, zero past ``context_lens``.

    Gathers whole blocks (one index op over block ids, contiguous copies) rather than single rows. Zeroing matters:
    unwritten cache rows may hold NaN/inf, and ``0 * NaN`` would leak through masked probabilities.
    """
    num_seqs, block_size, width = block_tables.shape[0], kv_cache.shape[1], kv_cache.shape[-1]
    num_blocks = -(-num_positions // block_size)
    table = block_tables.to(device=kv_cache.device, dtype=torch.long)[:, :num_blocks].reshape(-1)
    # index_select + index_fill_: several times faster on CPU than advanced indexing and a broadcast masked_fill.
    # On the 2-D view [num_blocks, block_size * width]: 0.54 vs 1.23 ms for 608 blocks on an idle CPU (one run).
    rows = kv_cache.view(kv_cache.shape[0], -1).index_select(0, table).view(num_seqs, num_blocks * block_size, width)
    pos = torch.arange(num_blocks * block_size, device=kv_cache.device)
    invalid = pos[None, :] >= context_lens[:, None]  # [N, P]
    if rows.is_cuda:  # nonzero() reads its count back to the host: a stream sync per layer
        rows.masked_fill_(invalid[..., None], 0)
    else:
        rows.view(-1, width).index_fill_(0, invalid.reshape(-1).nonzero().squeeze(1), 0)
    return rows[:, :num_positions]


def _masked_softmax(scores: Tensor, allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Softmax over the last dim in fp32 (fp64 stays fp64) with disallowed entries at -inf, cast to ``dtype``."""
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    # An additive -inf bias broadcasts much faster on CPU than a broadcast masked_fill.
    bias = torch.zeros(allowed.shape, dtype=softmax_dtype, device=scores.device).masked_fill_(~allowed, float("-inf"))
    probs = (scores.to(softmax_dtype) + bias).softmax(dim=-1)
    return probs.to(dtype)


def mla_prefill(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens: Tensor,
    context_lens: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    scale: float,
) -> Tensor:
    """Expanded (non-absorbed) causal MLA for a packed varlen batch of query chunks over a paged latent cache.

    Per sequence: ``k = [c W_uk^T ; kr]`` (kr broadcast to all heads, no rotary), ``v = c W_uv^T``,
    ``p = softmax_fp32(q k^T * scale + causal)``, cast to ``q.dtype``, ``o = p v``. The softmax runs in fp32 for
    fp32 and narrower inputs and in fp64 for fp64 inputs (so the op can serve as an fp64 oracle).

    Args:
        q: ``[T, Hm, Dn+Dr]``; rows ``cu_seqlens[i]:cu_seqlens[i+1]`` are the LAST ``q_len_i`` positions of the
            ``context_lens[i]`` tokens of sequence i (all of whose latents are already in ``kv_cache``).
        kv_cache: ``[num_blocks, block_size, R+Dr]`` rows ``[c ; kr]``; read only.
        block_tables: ``[N, max_blocks]`` int block ids per sequence; entries past the context may be any valid id.
        cu_seqlens: ``[N+1]`` int cumulative query lengths.
        context_lens: ``[N]`` int tokens of context per sequence, queries included (``>= q_len_i``).
        w_uk: ``[Hm, Dn, R]`` key up-projection of the latent per head (the layer's ``kv_b`` rows, any strides).
        w_uv: ``[Hm, Dv, R]`` value up-projection; the latents are cast to its dtype for both projections.
        scale: softmax scale, ``(Dn+Dr) ** -0.5`` for the model.

    Returns:
        ``[T, Hm, Dv]`` in ``q.dtype``. The query at context position ``p`` attends to positions ``<= p``.
    """
    num_tokens, num_heads, _ = q.shape
    rank, v_head_dim = w_uk.shape[-1], w_uv.shape[1]
    device = q.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    ctx = context_lens.to(device=device, dtype=torch.long)
    q_lens = cu[1:] - cu[:-1]  # [N]
    num_seqs = q_lens.shape[0]
    if num_tokens == 0:
        return q.new_zeros(0, num_heads, v_head_dim)
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())  # host syncs: acceptable in the reference

    # Queries padded to [N, Qmax]; padded rows are computed and then dropped.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    row_in_seq = torch.arange(num_tokens, device=device) - cu[seq_of_token]  # [T]
    q_pad = q.new_zeros(num_seqs, max_q, *q.shape[1:])
    q_pad[seq_of_token, row_in_seq] = q

    latents = _gather_context(kv_cache, block_tables, ctx, max_ctx).to(w_uv.dtype)  # [N, P, R+Dr]
    c, kr = latents[..., :rank], latents[..., rank:]
    k_nope = torch.einsum("npr,hdr->nphd", c, w_uk)  # [N, P, Hm, Dn]
    v = torch.einsum("npr,hvr->nphv", c, w_uv)  # [N, P, Hm, Dv]
    k = torch.cat([k_nope, kr[:, :, None, :].expand(-1, -1, num_heads, -1)], dim=-1).to(q.dtype)  # [N, P, Hm, Dq]

    scores = torch.einsum("nqhd,nphd->nhqp", q_pad, k) * scale  # [N, Hm, Qmax, P]
    q_pos = (ctx - q_lens)[:, None] + torch.arange(max_q, device=device)  # [N, Qmax] context position of query
    allowed = torch.arange(max_ctx, device=device)[None, None, :] <= q_pos[:, :, None]  # [N, Qmax, P]
    probs = _masked_softmax(scores, allowed[:, None], q.dtype)
    o_pad = torch.einsum("nhqp,nphv->nqhv", probs, v.to(q.dtype))  # [N, Qmax, Hm, Dv]
    return o_pad[seq_of_token, row_in_seq]


def mla_decode(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """Latent attention (the absorbed MLA decode of spec §4.2 without its projections): MQA of every head over the
    shared cache rows, one query per sequence at its last context position.

    ``o[h] = sum_t softmax_t(scale * q[h] . [c_t ; kr_t]) c_t``. The layer builds the query
    ``q[h] = [W_uk[h]^T q_n[h] ; q_r[h]]`` and projects the output with ``W_uv[h]``.

    Args:
        q: ``[N, Hm, R+Dr]`` latent queries; row i is the query of the last of ``context_lens[i]`` positions of
            sequence i.
        kv_cache: ``[num_blocks, block_size, R+Dr]``; read only. The query token's own row must already be written.
        block_tables: ``[N, max_blocks]`` int block ids per sequence.
        context_lens: ``[N]`` int, ``>= 1``.
        kv_lora_rank: ``R``: the first ``R`` columns of a cache row are the value.
        scale: the scale of the expanded form (``192 ** -0.5`` for the model, not ``576 ** -0.5``).

    Returns:
        ``[N, Hm, R]`` latent output in ``q.dtype`` (scores and values in ``q.dtype``, softmax in fp32 or fp64).
    """
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], kv_lora_rank)
    ctx = context_lens.to(device=q.device, dtype=torch.long)
    max_ctx = int(ctx.max())  # host sync: acceptable in the reference
    latents = _gather_context(kv_cache, block_tables, ctx, max_ctx).to(q.dtype)  # [N, P, R+Dr]
    scores = torch.einsum("nhk,npk->nhp", q, latents) * scale  # [N, Hm, P]
    allowed = torch.arange(max_ctx, device=q.device)[None, :] < ctx[:, None]  # [N, P]
    probs = _masked_softmax(scores, allowed[:, None], q.dtype)
    return torch.einsum("nhp,npr->nhr", probs, latents[..., :kv_lora_rank])  # [N, Hm, R]
