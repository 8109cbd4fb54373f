"""Reference Block Attention Residuals mix (model-spec §7.2): a softmax over depth, per token, of the block summaries
and the running partial block, scored by one learned pseudo-query on the RMS-normalised sources.

Pure PyTorch; the specification and the test oracle for any fused kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor


def attn_res_mix(blocks: Tensor, partial: Tensor | None, norm_weight: Tensor, proj_weight: Tensor,
                 eps: float) -> Tensor:
    """Mix the sources of every token: ``sum_j softmax_j(logit) * rows_j`` over ``rows = blocks + [partial]``.

    ``logit_j = sum_c rows_j[c] * rsqrt(mean(rows_j**2) + eps) * norm_weight[c] * proj_weight[0, c]`` (no 1/sqrt(d)
    scale). The raw rows are mixed, not the normalised ones. All math runs in fp32 (fp64 if the sources are fp64);
    the result is cast back to the sources' dtype.

    Args:
        blocks: ``[n, T, d]`` completed sources (the embedding snapshot, then one sum per completed block); ``n``
            may be 0 when ``partial`` is given.
        partial: ``[T, d]`` running partial sum of the current block, or ``None`` (then ``n >= 1``).
        norm_weight: ``[d]`` the RMSNorm weight of this mix (``*_res_norm.weight``).
        proj_weight: ``[1, d]`` (or ``[d]``) the pseudo-query (``*_res_proj.weight``).
        eps: ``rms_norm_eps``.

    Returns:
        ``[T, d]`` in the dtype of ``blocks`` (of ``partial`` when ``n == 0``).

    Memory: besides the output, an fp32 ``[T, d]`` accumulator and at most two fp32 ``[T, d]`` temporaries at a time
    (one source's fp32 copy, none for fp32 sources, and its squares); the sources are visited twice (scores, then
    the weighted sum) and never stacked.
    """
    sources = list(blocks.unbind(0)) + ([] if partial is None else [partial])
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    out_dtype = sources[0].dtype
    cdt = torch.promote_types(out_dtype, torch.float32)
    query = norm_weight.to(cdt) * proj_weight.reshape(-1).to(cdt)  # [d]
    logits = torch.stack([_score(src.to(cdt), query, eps) for src in sources])  # [n + 1, T]
    probs = logits.softmax(dim=0)
    out = torch.zeros(sources[0].shape, dtype=cdt, device=sources[0].device)
    for p, src in zip(probs, sources, strict=True):
        out.addcmul_(src.to(cdt), p.unsqueeze(-1))
    return out.to(out_dtype)


def _score(rows: Tensor, query: Tensor, eps: float) -> Tensor:
    """``[T, d] -> [T]``: the pseudo-query dotted with the RMS-normalised rows (norm weight folded into ``query``)."""
    return (rows @ query) * torch.rsqrt(rows.pow(2).mean(-1) + eps)
