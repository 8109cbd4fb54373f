"""Latent MLA decode on a CPU: the `cpu` backend of `mla_decode` (same contract as `ref.mla_decode`), for fp32 and
bf16 CPU tensors.

The reference walks the context with an online softmax whose many small in-place ops dominate a decode step of short
contexts. Here the cache rows of a group of sequences are gathered by whole blocks (one index op) and attended by
PyTorch's CPU flash-attention kernel in one call: the heads of a sequence are the query rows of a single key/value
head (MQA), keys and values are the same latent rows ``[c ; kr]`` (the kernel wants one head size; the output's last
``Dr`` columns are dropped), softmax in fp32 inside the kernel, no score matrix. Sequences are grouped by context
length, so a long context does not pad short ones. Rows past a context within a call are zeroed (unwritten rows may
hold NaN/inf, and ``0 * NaN`` would leak through a zero probability) and masked by a ``-inf`` bias. A group whose
rows exceed one call's bound is walked in pieces of context positions; a piece attends only the sequences that
reach into it, and the pieces are merged by their logsumexps (flash-decoding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaserve.ops.mla.ref import _context_steps

# This backend takes the same calls as the prefill backend (CPU tensors, fp32 / bf16 queries; fp64 runs the
# reference, the oracle).
from deltaserve.ops.mla.sdpa import _merge
from deltaserve.ops.mla.sdpa import supports as supports

# Elements of the cache rows gathered for one kernel call, [N, rows, R+Dr]: the bound on this op's temporaries.
# 4 Mi elements (8 MiB in bf16): 32 sequences of 288-wide rows get 448 rows a call, one sequence 14,560.
_ROWS_ELEMS = 1 << 22
# Padding positions a sequence may get from sharing a call with longer contexts. Measured (1 thread, batches of 8 to
# 64 mixed contexts of 1 to 2,000): 64 to 256 within noise of each other; a call per distinct length up to 1.6x
# slower, one call padded to the longest context up to 6x slower.
_SLACK_ROWS = 128


def mla_decode_cpu(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """Latent attention of one query per sequence over its paged cache rows through the CPU flash-attention kernel;
    see `ref.mla_decode` for the contract (arguments, shapes).

    Returns:
        ``[N, Hm, R]`` latent output in ``q.dtype``. Scores accumulate in fp32 and the softmax runs in fp32 (the
        kernel's accumulation type for fp32 and bf16); the probabilities meet the values in ``q.dtype``.
    """
    num_seqs, num_heads, width = q.shape
    if num_seqs == 0:
        return q.new_zeros(0, num_heads, kv_lora_rank)
    block_size = kv_cache.shape[1]
    ctx = context_lens.tolist()  # a CPU tensor: no device sync
    groups = _groups(ctx, block_size)
    if len(groups) == 1 and max(ctx) <= _rows(num_seqs, width, block_size):  # one call, in batch order
        return _attend(q, kv_cache, block_tables, context_lens, ctx, 0, max(ctx), kv_lora_rank, scale)[0]
    out = q.new_empty(num_seqs, num_heads, kv_lora_rank)
    for group in groups:
        seqs = torch.tensor(group)
        out[seqs] = _attend_group(q[seqs], kv_cache, block_tables[seqs], context_lens[seqs], [ctx[i] for i in group],
                                  kv_lora_rank, scale)
    return out


def _rows(num_seqs: int, width: int, block_size: int) -> int:
    """Context positions one kernel call attends for ``num_seqs`` sequences (whole blocks, at least one)."""
    return max(block_size, _ROWS_ELEMS // (num_seqs * width) // block_size * block_size)


def _groups(ctx: list[int], block_size: int) -> list[list[int]]:
    """The sequences by decreasing context, in groups padded to their longest context (in whole blocks) with at
    most ``_SLACK_ROWS`` positions of padding per sequence."""
    groups: list[list[int]] = []
    padded = 0
    for i in sorted(range(len(ctx)), key=lambda i: -ctx[i]):
        if groups and padded - ctx[i] <= _SLACK_ROWS:
            groups[-1].append(i)
        else:
            groups.append([i])
            padded = -(-ctx[i] // block_size) * block_size
    return groups


def _attend_group(q: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, ctx: list[int], rank: int,
                  scale: float) -> Tensor:
    """Sequences by decreasing context ``ctx``: one kernel call if their rows fit `_rows`, else pieces of that many
    positions merged by their logsumexps, each piece over the sequences that reach into it (a prefix of the group;
    all of it for the first piece). Returns ``[n, Hm, R]`` in ``q.dtype``."""
    steps = _context_steps(kv_cache.shape[1], ctx[0], _rows(len(ctx), q.shape[-1], kv_cache.shape[1]))
    o_acc, lse_acc = _attend(q, kv_cache, block_tables, context_lens, ctx, *steps[0], rank, scale)
    if len(steps) == 1:
        return o_acc
    o_acc = o_acc.float()
    for a, b in steps[1:]:
        n = sum(1 for length in ctx if length > a)
        o, lse = _attend(q[:n], kv_cache, block_tables[:n], context_lens[:n], ctx[:n], a, b, rank, scale)
        _merge(o_acc[:n], lse_acc[:n], o, lse)
    return o_acc.to(q.dtype)


def _attend(q: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, ctx: list[int], start: int,
            stop: int, rank: int, scale: float) -> tuple[Tensor, Tensor]:
    """Queries ``[n, Hm, R+Dr]`` over context positions ``start..stop-1`` (``start`` on a block, every sequence
    with a position there): output ``[n, Hm, R]`` in ``q.dtype`` and the fp32 logsumexp ``[n, Hm]`` of the scaled
    scores."""
    num_seqs, block_size, width = q.shape[0], kv_cache.shape[1], kv_cache.shape[-1]
    first, last = start // block_size, -(-stop // block_size)
    table = block_tables[:, first:last].reshape(-1)
    # [n, whole blocks, R+Dr]; one index op over block ids (contiguous copies of whole blocks).
    latents = kv_cache.view(kv_cache.shape[0], -1).index_select(0, table).view(num_seqs, -1, width)
    mask = None
    if min(ctx) < stop:  # some sequence ends before the range does
        invalid = torch.arange(first * block_size, last * block_size)[None, :] >= context_lens[:, None]  # [n, P']
        # index_fill_ over the flat rows: faster on CPU than a broadcast masked_fill.
        latents.view(-1, width).index_fill_(0, invalid.view(-1).nonzero().squeeze(1), 0)
        mask = torch.zeros(num_seqs, 1, 1, stop - start, dtype=q.dtype)
        mask.masked_fill_(invalid[:, None, None, : stop - start], float("-inf"))
    keys = latents[:, None, : stop - start].to(q.dtype)  # [n, 1, P, R+Dr]: one key/value head
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[:, None], keys, keys, attn_mask=mask, scale=scale,
    )  # [n, 1, Hm, R+Dr], [n, 1, Hm]
    return out[:, 0, :, :rank], lse[:, 0]
