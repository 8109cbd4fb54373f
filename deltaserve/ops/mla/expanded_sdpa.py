"""MLA prefill on a GPU through `F.scaled_dot_product_attention` on expanded keys: the `expanded_sdpa` backend of
`mla_prefill` (same contract as `ref.mla_prefill`), for CUDA tensors in bf16, fp16 or fp32.

Each sequence's cached latents are gathered from the paged cache and expanded once (`sdpa._Expansion`: one GEMM to
``[c W_uk^T ; kr]`` and ``c W_uv^T``, zero-padded to the query head size, which the flash kernel requires), then
attended by PyTorch's fused attention (flash or memory-efficient kernels: tiled, online softmax in fp32, no score
matrix). A whole prompt is plain causal attention (`is_causal`, the flash path); a chunk after cached positions takes
the bottom-right causal mask (`causal_lower_right`: query i of a chunk of Q at the end of L positions sees keys
<= L - Q + i), which is exactly causality there; a single query sees everything. Sequence lengths come from the
host (`cu_seqlens_host`, `context_lens_host`), so the op reads nothing back from the device.

Memory: the expanded keys and values of one sequence at a time; a call whose longest context would expand past
`MAX_EXPANDED_ELEMS` takes the reference (flash-style in bounded memory), as does a call without host lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from deltaserve.ops.mla.sdpa import _Expansion, _pad_last

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MAX_EXPANDED_ELEMS = 1 << 28
"""Most elements of one sequence's expanded keys plus values (512 MiB in bf16): 128 heads of 192 hold about 5,000
positions, 8 heads about 87,000."""


def supports(q: Tensor, kv_cache: Tensor, block_tables: Tensor, cu_seqlens: Tensor, context_lens: Tensor,
             w_uk: Tensor, w_uv: Tensor, *, scale: float, cu_seqlens_host: Sequence[int] | None = None,
             context_lens_host: Sequence[int] | None = None) -> bool:
    """CUDA tensors of a fused-attention dtype, host lengths given, every context within `MAX_EXPANDED_ELEMS`."""
    if not (q.is_cuda and kv_cache.is_cuda and q.dtype in DTYPES) or cu_seqlens_host is None \
            or context_lens_host is None:
        return False
    head_dim = max(q.shape[-1], w_uv.shape[1])
    return max(context_lens_host, default=0) * q.shape[1] * head_dim * 2 <= MAX_EXPANDED_ELEMS


def mla_prefill_expanded(
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
    """Expanded causal MLA over a paged latent cache through `F.scaled_dot_product_attention`, one sequence at a
    time; see `ref.mla_prefill` for the contract. Runs on any device (the CPU tests run it in fp32 against the
    reference); dispatched on CUDA only, where the fused kernels serve it.

    Returns:
        ``[T, Hm, Dv]`` in ``q.dtype``.
    """
    num_tokens, num_heads, q_dim = q.shape
    v_dim = w_uv.shape[1]
    head_dim = max(q_dim, v_dim)
    out = q.new_empty(num_tokens, num_heads, v_dim)
    expand = _Expansion(torch.cat([w_uk, w_uv], dim=1).reshape(-1, w_uk.shape[-1]).t(), num_heads, w_uk.shape[1],
                        q.dtype, head_dim)
    q = _pad_last(q, head_dim)
    cu = list(cu_seqlens_host) if cu_seqlens_host is not None else cu_seqlens.tolist()
    ctx = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    for i in range(len(ctx)):
        q_len, length = cu[i + 1] - cu[i], ctx[i]
        if q_len == 0:
            continue
        k, v = expand(kv_cache, block_tables[i : i + 1], context_lens[i : i + 1], 0, length)  # [1, L, Hm, D]
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]  # [1, Hm, Q, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [1, Hm, L, D]
        if q_len == length:  # a whole prompt: top-left causal is bottom-right causal
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=q_len > 1, scale=scale)
        elif q_len == 1:  # one query, the last position: it sees every key
            o = F.scaled_dot_product_attention(qi, k, v, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=causal_lower_right(q_len, length), scale=scale)
        out[cu[i] : cu[i + 1]] = o[0, :, :, :v_dim].transpose(0, 1)
    return out
