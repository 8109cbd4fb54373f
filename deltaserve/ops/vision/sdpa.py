"""Vision attention through PyTorch's `scaled_dot_product_attention`: the `sdpa` backend of `varlen_attention`
(same contract as `ref.varlen_attention`). One call per image; on a CPU the flash kernel tiles the scores, so an
image of n patches needs no [heads, n, n] score matrix (the reference's would be 17 GB in fp32 at K2.5's 16,384
patches and 16 heads)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What this backend takes (fp64 runs the reference: the fp64 oracle)."""


def supports(q: Tensor, *args: object, **kwargs: object) -> bool:
    """Whether a `varlen_attention` call can take this path: fp32, bf16 or fp16 queries."""
    return q.dtype in DTYPES


def varlen_attention_sdpa(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Sequence[int], scale: float) -> Tensor:
    """Bidirectional attention within each segment; see `ref.varlen_attention`."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, Dh]
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
    return out
