"""MLA prefill through PyTorch's CPU flash-attention kernel: the `sdpa` backend of `mla_prefill` (same contract as
`ref.mla_prefill`), for fp32 and bf16 CPU tensors.

Context latents are gathered from the paged cache and expanded once to the per-head keys ``[c W_uk^T ; kr]`` and
values ``c W_uv^T`` (zero-padded to the query head size, which the kernel requires), then attended by
``aten._scaled_dot_product_flash_attention_for_cpu`` (tiled inside, online softmax in fp32, no score matrix), which
also returns each query's logsumexp. Short contexts are expanded together, sequences in groups of similar length,
and the whole prompts of a group attended in one causal call over an end-padded batch. A long context is walked in
pieces of bounded size whose outputs are merged with their logsumexps: the prefix before the query chunk is visible
to every query (non-causal); a piece of the chunk that starts at chunk row ``t0`` is attended by the queries from
``t0`` on with the kernel's top-left causal mask (query ``i`` of the call sees keys ``j <= i``), which is exactly
causality there. Memory: the expanded keys and values of one group or piece, plus the queries and outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from deltaserve.ops.mla.ref import _gather_context

DTYPES = (torch.float32, torch.bfloat16)
"""What this backend takes (fp64 runs the reference: the fp64 oracle)."""

# Elements of the expanded keys plus values of one piece or group, [rows, H, D] each: the bound on this op's
# temporaries besides the queries and outputs. 8 heads of D = 96 (the embedded model): 2,730 rows (16 MiB in fp32),
# so a 2,048-token prompt is one kernel call with nothing to merge.
_PIECE_ELEMS = 1 << 22


def available() -> bool:
    """Whether this torch has the CPU flash-attention op."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def supports(q: Tensor, kv_cache: Tensor, *args: object, **kwargs: object) -> bool:  # host lengths: any
    """Whether an `mla_prefill` call can take this path: CPU tensors, queries in fp32 or bf16."""
    return q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype in DTYPES


def mla_prefill_sdpa(
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
    """Expanded causal MLA over a paged latent cache through the CPU flash-attention kernel; see `ref.mla_prefill`
    for the contract (arguments, shapes, causality, dtypes).

    Returns:
        ``[T, Hm, Dv]`` in ``q.dtype``. The softmax runs in fp32 (the kernel's accumulation type for fp32 and bf16);
        queries, keys and values are in ``q.dtype`` as in the reference.
    """
    num_tokens, num_heads, q_dim = q.shape
    v_dim = w_uv.shape[1]
    head_dim = max(q_dim, v_dim)  # the kernel wants one head size for q, k and v: the narrower side is zero-padded
    out = q.new_empty(num_tokens, num_heads, v_dim)
    # One GEMM expands latents to every head's key and value halves: [R, Hm * (Dn + Dv)].
    expand = _Expansion(torch.cat([w_uk, w_uv], dim=1).reshape(-1, w_uk.shape[-1]).t(), num_heads, w_uk.shape[1],
                        q.dtype, head_dim)
    q = _pad_last(q, head_dim)  # [T, Hm, D]
    cu = list(cu_seqlens_host) if cu_seqlens_host is not None else cu_seqlens.tolist()  # CPU tensors: no sync
    ctx = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    rows = max(1, _PIECE_ELEMS // (2 * num_heads * head_dim))
    for group in _groups([i for i in range(len(ctx)) if cu[i + 1] > cu[i]], ctx, kv_cache.shape[1], rows):
        if ctx[group[0]] > rows:  # a long context, alone: expanded piece by piece
            i = group[0]
            out[cu[i] : cu[i + 1]] = _attend_pieces(
                q[cu[i] : cu[i + 1]], ctx[i], rows, v_dim, scale,
                partial(expand, kv_cache, block_tables[i : i + 1], context_lens[i : i + 1]),
            )
            continue
        # Short contexts: gathered and expanded together (one GEMM for the group); whole prompts attended in one
        # batched call, chunks after a cached prefix one by one.
        seqs = torch.tensor(group)
        k_all, v_all = expand(kv_cache, block_tables[seqs], context_lens[seqs], 0, ctx[group[-1]])  # [n, L, Hm, D]
        whole = [j for j, i in enumerate(group) if cu[i + 1] - cu[i] == ctx[i]]
        if whole:
            rows_of = slice(None) if len(whole) == len(group) else torch.tensor(whole)
            _attend_whole(q, out, cu, [group[j] for j in whole], k_all[rows_of], v_all[rows_of], scale)
        for j, i in enumerate(group):
            if cu[i + 1] - cu[i] < ctx[i]:
                out[cu[i] : cu[i + 1]] = _attend_pieces(
                    q[cu[i] : cu[i + 1]], ctx[i], rows, v_dim, scale,
                    partial(_rows, k_all[j : j + 1], v_all[j : j + 1]),
                )
    return out


def _groups(seqs: list[int], ctx: list[int], block_size: int, rows: int) -> list[list[int]]:
    """The sequences ``seqs`` in groups of increasing context length whose gathered rows (count x the longest
    context, in whole blocks) fit in ``rows``; a sequence with a longer context is a group of its own."""
    groups: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: ctx[i]):
        padded = -(-ctx[i] // block_size) * block_size
        if groups and (len(groups[-1]) + 1) * padded <= rows:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _attend_whole(q: Tensor, out: Tensor, cu: list[int], seqs: list[int], k: Tensor, v: Tensor,
                  scale: float) -> None:
    """Whole prompts ``seqs`` (queries at every context position) in one causal kernel call over a batch padded at
    the end, written into ``out`` ``[T, Hm, Dv]``. ``k``, ``v``: ``[len(seqs), >= longest, Hm, D]``, zero past each
    context. A padded key lies after every real query of its row, so the top-left causal mask hides it; padded
    query rows are dropped."""
    q_pad = pad_sequence([q[cu[i] : cu[i + 1]] for i in seqs], batch_first=True)  # [n, L, Hm, D]
    length = q_pad.shape[1]
    o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_pad.transpose(1, 2), k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2), 0.0, True, scale=scale,
    )  # [n, Hm, L, D]
    o = o.transpose(1, 2)[..., : out.shape[-1]]  # [n, L, Hm, Dv]
    for j, i in enumerate(seqs):
        out[cu[i] : cu[i + 1]] = o[j, : cu[i + 1] - cu[i]]


def _rows(k: Tensor, v: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Positions ``start..stop-1`` of expanded keys and values ``[1, L, Hm, D]``."""
    return k[:, start:stop], v[:, start:stop]


def _attend_pieces(q: Tensor, ctx: int, rows: int, v_dim: int, scale: float,
                   keys_values: Callable[[int, int], tuple[Tensor, Tensor]]) -> Tensor:
    """One sequence's chunk: queries ``[Q, Hm, D]`` (padded to D) at the last Q of ``ctx`` positions ->
    ``[Q, Hm, Dv]`` (``q.dtype`` from one piece, fp32 merged from several). ``keys_values(a, b)`` gives the keys and
    values ``[1, b - a, Hm, D]`` of positions a..b-1, at most ``rows`` of them at a time."""
    q_len = q.shape[0]
    first = ctx - q_len  # context position of the first query

    def attend(a: int, b: int, t: int) -> tuple[Tensor, Tensor]:
        """Queries from chunk row t on over positions a..b-1: ([Q - t, Hm, Dv], logsumexp [Q - t, Hm] fp32)."""
        k, v = keys_values(a, b)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None, t:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, a >= first, scale=scale,
        )  # [1, Hm, Q - t, D] (laid out as [1, Q - t, Hm, D]), [1, Hm, Q - t]
        return o[0, :, :, :v_dim].transpose(0, 1), lse[0].t()

    # (start, stop, first query row): prefix pieces for every query, chunk pieces from their own row on. The first
    # piece holds position 0, which every query sees.
    pieces = [(a, min(a + rows, first), 0) for a in range(0, first, rows)]
    pieces += [(first + t, min(first + t + rows, ctx), t) for t in range(0, q_len, rows)]
    o_seq, lse_seq = attend(*pieces[0])
    if len(pieces) > 1:
        o_seq, lse_seq = o_seq.float(), lse_seq.clone()
    for a, b, t in pieces[1:]:
        _merge(o_seq[t:], lse_seq[t:], *attend(a, b, t))
    return o_seq


@dataclass(frozen=True, slots=True)
class _Expansion:
    """Expands cached latents to keys and values: ``(kv_cache, block_tables [n, max_blocks], context_lens [n],
    start, stop)`` -> keys and values ``[n, stop - start, Hm, D]`` in ``dtype`` of positions ``start..stop-1``
    (zero past a context). The latents are cast to the weights' dtype for the projection (as the reference), the
    results to ``dtype``, zero-padded to D."""

    w_kv: Tensor  # [R, Hm * (Dn + Dv)]
    num_heads: int
    nope_dim: int
    dtype: torch.dtype
    head_dim: int

    def __call__(self, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, start: int,
                 stop: int) -> tuple[Tensor, Tensor]:
        aligned = start - start % kv_cache.shape[1]  # the gather starts on a block
        latents = _gather_context(kv_cache, block_tables, context_lens, aligned, stop)[:, start - aligned :]
        latents = latents.to(self.w_kv.dtype)  # [n, P, R+Dr]
        rank = self.w_kv.shape[0]
        # One 2-D GEMM over every row (a 3-D matmul would copy the weight once per sequence).
        kv = latents.flatten(0, 1)[:, :rank] @ self.w_kv
        kv = kv.view(*latents.shape[:2], self.num_heads, -1)  # [n, P, Hm, Dn+Dv]
        kr = latents[..., None, rank:].expand(-1, -1, self.num_heads, -1)  # [n, P, Hm, Dr], shared by the heads
        k = _pad_last(torch.cat([kv[..., : self.nope_dim], kr], dim=-1).to(self.dtype), self.head_dim)
        v = _pad_last(kv[..., self.nope_dim :].to(self.dtype), self.head_dim)
        return k, v


def _pad_last(x: Tensor, size: int) -> Tensor:
    """``x`` zero-padded on its last dimension to ``size`` (itself when already that wide)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _merge(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor) -> None:
    """Fold one piece's normalised output ``o`` ``[Q, Hm, Dv]`` with logsumexp ``lse`` ``[Q, Hm]`` into the running
    fp32 ``o_acc`` and ``lse_acc``, in place: the softmax over the union of both key sets."""
    lse_new = torch.logaddexp(lse_acc, lse)
    o_acc.mul_((lse_acc - lse_new).exp_().unsqueeze(-1))
    o_acc.add_(o.float().mul_((lse - lse_new).exp_().unsqueeze(-1)))
    lse_acc.copy_(lse_new)
