"""Reference paged MLA without positional encoding (model-spec §4): cache write, expanded prefill, latent decode.

Pure PyTorch; the specification and test oracle for any fast backend. The cache row of a token is ``[c ; kr]``. The
layer owns ``kv_b``: it passes its key and value halves to the prefill, and absorbs them around the decode (which is
pure latent attention, MQA over the cache rows). Both attend block by block over the context with an online softmax,
so a long context costs memory for its cache rows only.
"""

from __future__ import annotations

from collections.abc import Sequence

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


# Bounds on the temporaries of one attention step, whatever the context length: context rows gathered (and expanded
# per head) at a time, and elements of one scores tile [N, Hm, queries, rows]. A 1M-token context then costs memory
# for its latent cache only, and a 64K-token chunk is attended tile by tile with an online softmax (flash-style).
_CONTEXT_ROWS = 1024
_TILE_ELEMS = 1 << 22


def _gather_context(kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, start: int, stop: int) -> Tensor:
    """``[N, stop - start, R+Dr]`` cache rows of positions ``start..stop-1`` of each sequence, zero past
    ``context_lens``; ``start`` is a multiple of the block size.

    Gathers whole blocks (one index op over block ids, contiguous copies) rather than single rows. Zeroing matters:
    unwritten cache rows may hold NaN/inf, and ``0 * NaN`` would leak through masked probabilities.
    """
    num_seqs, block_size, width = block_tables.shape[0], kv_cache.shape[1], kv_cache.shape[-1]
    first, last = start // block_size, -(-stop // block_size)
    num_blocks = last - first
    table = block_tables.to(device=kv_cache.device, dtype=torch.long)[:, first:last].reshape(-1)
    # index_select + index_fill_: several times faster on CPU than advanced indexing and a broadcast masked_fill.
    # On the 2-D view [num_blocks, block_size * width]: 0.54 vs 1.23 ms for 608 blocks on an idle CPU (one run).
    rows = kv_cache.view(kv_cache.shape[0], -1).index_select(0, table).view(num_seqs, num_blocks * block_size, width)
    pos = torch.arange(first * block_size, last * block_size, device=kv_cache.device)
    invalid = pos[None, :] >= context_lens[:, None]  # [N, P]
    if rows.is_cuda:  # nonzero() reads its count back to the host: a stream sync per layer
        rows.masked_fill_(invalid[..., None], 0)
    else:
        rows.view(-1, width).index_fill_(0, invalid.reshape(-1).nonzero().squeeze(1), 0)
    return rows[:, : stop - start]


def _context_steps(block_size: int, num_positions: int, rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges of about ``rows`` context positions (whole blocks) covering ``0..num_positions-1``."""
    step = max(1, rows // block_size) * block_size
    return [(a, min(a + step, num_positions)) for a in range(0, num_positions, step)]


def _fold_block(m: Tensor, l: Tensor, acc: Tensor, scores: Tensor, values: Tensor) -> None:
    """Fold one block of keys into a running softmax (online softmax), all in place.

    ``m``, ``l``: ``[..., Q]`` running max and denominator; ``acc``: ``[..., Q, Dv]`` unnormalised output, all in the
    softmax dtype; ``scores``: ``[..., Q, K]`` in the softmax dtype, -inf where masked, **overwritten** (in place:
    no large temporaries); ``values``: ``[..., K, Dv]`` (the probabilities are cast to their dtype for the product, as
    the one-shot form casts them). A row must meet an allowed key in its first block (position 0 is allowed for every
    query), so ``m`` is finite from then on.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = (m - m_new).exp_()
    p = scores.sub_(m_new.unsqueeze(-1)).exp_()
    l.mul_(alpha).add_(p.sum(dim=-1))
    acc.mul_(alpha.unsqueeze(-1)).add_((p.to(values.dtype) @ values).to(acc.dtype))
    m.copy_(m_new)


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
    cu_seqlens_host: Sequence[int] | None = None,
    context_lens_host: Sequence[int] | None = None,
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
        cu_seqlens_host, context_lens_host: the same two as host lists, where the caller has them (backends that
            plan on the host read these, not the device); the reference does not use them.

    Returns:
        ``[T, Hm, Dv]`` in ``q.dtype``. The query at context position ``p`` attends to positions ``<= p``.

    Computed over blocks of the context and tiles of the queries with an online softmax (the normalisation applied
    after the sum): the same numbers up to float rounding, in memory bounded by the tile sizes, not the context.
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
    q_first = ctx - q_lens  # [N] context position of each sequence's first query
    first_max, first_min = int(q_first.max()), int(q_first.min())
    sdt = torch.promote_types(q.dtype, torch.float32)

    # Queries padded to [N, Hm, Qmax, Dq]; padded rows are computed and then dropped.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    row_in_seq = torch.arange(num_tokens, device=device) - cu[seq_of_token]  # [T]
    q_pad = q.new_zeros(num_seqs, max_q, *q.shape[1:])
    q_pad[seq_of_token, row_in_seq] = q
    q_pad = q_pad.transpose(1, 2).contiguous()
    q_pos = q_first[:, None] + torch.arange(max_q, device=device)  # [N, Qmax]

    # Flash-style: context blocks outside (gathered and expanded once), query tiles inside, an online softmax per
    # query row. Memory is O(N x Hm x (Qmax + tile)) whatever the context length.
    rows = _context_steps(kv_cache.shape[1], max_ctx, _CONTEXT_ROWS)
    tile = max(1, _TILE_ELEMS // (num_seqs * num_heads * (rows[0][1] - rows[0][0])))
    m = torch.full((num_seqs, num_heads, max_q), float("-inf"), dtype=sdt, device=device)
    l = torch.zeros(num_seqs, num_heads, max_q, dtype=sdt, device=device)
    acc = torch.zeros(num_seqs, num_heads, max_q, v_head_dim, dtype=sdt, device=device)
    for a, b in rows:
        latents = _gather_context(kv_cache, block_tables, ctx, a, b).to(w_uv.dtype)  # [N, B, R+Dr]
        c, kr = latents[..., :rank], latents[..., rank:]
        k_nope = torch.einsum("npr,hdr->nhpd", c, w_uk)  # [N, Hm, B, Dn]
        v = torch.einsum("npr,hvr->nhpv", c, w_uv).to(q.dtype)  # [N, Hm, B, Dv]
        k = torch.cat([k_nope, kr[:, None].expand(-1, num_heads, -1, -1)], dim=-1).to(q.dtype)  # [N, Hm, B, Dq]
        pos = torch.arange(a, b, device=device)
        for t0 in range(0, max_q, tile):
            t1 = min(t0 + tile, max_q)
            if a > first_max + t1 - 1:  # the block lies after every query of the tile
                continue
            scores = (q_pad[:, :, t0:t1] @ k.transpose(-1, -2)).mul_(scale).to(sdt)  # [N, Hm, tile, B]
            if b - 1 > first_min + t0:  # some key of the block lies after some query: causal mask
                allowed = pos[None, None, :] <= q_pos[:, t0:t1, None]  # [N, tile, B]
                # An additive -inf bias broadcasts much faster on CPU than a broadcast masked_fill.
                bias = torch.zeros(allowed.shape, dtype=sdt, device=device).masked_fill_(~allowed, float("-inf"))
                scores += bias[:, None]
            _fold_block(m[:, :, t0:t1], l[:, :, t0:t1], acc[:, :, t0:t1], scores, v)
    o_pad = (acc / l.unsqueeze(-1)).to(q.dtype).transpose(1, 2)  # [N, Qmax, Hm, Dv]
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
    num_seqs, num_heads, _ = q.shape
    if num_seqs == 0:
        return q.new_zeros(0, num_heads, kv_lora_rank)
    ctx = context_lens.to(device=q.device, dtype=torch.long)
    max_ctx = int(ctx.max())  # host sync: acceptable in the reference
    sdt = torch.promote_types(q.dtype, torch.float32)
    # Context blocks with an online softmax: memory O(N x Hm x rows), not O(context).
    rows = max(_CONTEXT_ROWS, _TILE_ELEMS // (num_seqs * max(num_heads, kv_cache.shape[-1])))
    m = torch.full((num_seqs, num_heads), float("-inf"), dtype=sdt, device=q.device)
    l = torch.zeros(num_seqs, num_heads, dtype=sdt, device=q.device)
    acc = torch.zeros(num_seqs, num_heads, kv_lora_rank, dtype=sdt, device=q.device)
    for a, b in _context_steps(kv_cache.shape[1], max_ctx, rows):
        latents = _gather_context(kv_cache, block_tables, ctx, a, b).to(q.dtype)  # [N, B, R+Dr]
        scores = torch.einsum("nhk,npk->nhp", q, latents).mul_(scale).to(sdt)  # [N, Hm, B]
        allowed = torch.arange(a, b, device=q.device)[None, :] < ctx[:, None]  # [N, B]
        # An additive -inf bias broadcasts much faster on CPU than a broadcast masked_fill.
        bias = torch.zeros(allowed.shape, dtype=sdt, device=q.device).masked_fill_(~allowed, float("-inf"))
        scores += bias[:, None]
        _fold_block(m.unsqueeze(-1), l.unsqueeze(-1), acc.unsqueeze(-2), scores.unsqueeze(-2),
                    latents[:, None, :, :kv_lora_rank])
    return (acc / l.unsqueeze(-1)).to(q.dtype)  # [N, Hm, R]
