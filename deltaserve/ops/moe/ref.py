"""Reference MoE routing (noaux_tc group top-k, model-spec §5) and grouped gated experts (SiLU-GLU, or any
activation and weight format the caller passes, e.g. K3's SiTU with MXFP4 weights).

Pure PyTorch; the specification and test oracle for any fast backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul


def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    *,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[Tensor, Tensor]:
    """Choose ``top_k`` experts per token and their combine weights.

    Args:
        router_logits: ``[T, E]`` fp32 (``x32 @ W32^T``, computed by the caller; cast to fp32 if not already).
        correction_bias: ``[E]`` added to the scores for SELECTION only (``e_score_correction_bias``), or ``None``.
        top_k: experts per token.
        num_expert_group: groups the E experts are split into (contiguous, ``E % num_expert_group == 0``).
        topk_group: groups kept per token; the group step runs only if ``1 < num_expert_group`` and
            ``topk_group < num_expert_group``. A group's score is the sum of its top-2 biased scores.
        renormalize: divide the chosen weights by ``sum + 1e-20``.
        routed_scaling_factor: multiplies the final weights (2.446 for Kimi Linear).
        scoring_func: ``"sigmoid"`` (both real models) or ``"softmax"`` (over E).

    Returns:
        ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64)``; weights are the UNbiased scores of the
        chosen experts. Ids are sorted by biased score, descending (order does not affect the output).

    Raises:
        ValueError: unknown ``scoring_func``, or ``E`` not divisible by ``num_expert_group``.
    """
    # At least fp32: fp64 logits (an fp64 model, the reference oracle) keep their precision.
    logits = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)  # [T, E]

    if num_expert_group > 1 and topk_group < num_expert_group:
        num_tokens, num_experts = choice.shape
        if num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} must divide the {num_experts} experts")
        group_size = num_experts // num_expert_group
        grouped = choice.view(num_tokens, num_expert_group, group_size)
        group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~group_keep[..., None], float("-inf")).view(num_tokens, num_experts)

    topk_ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids.to(torch.int64)


def moe_experts(
    x: Tensor,
    w13: Any,
    w2: Any,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    act: Callable[[Tensor], Tensor] = silu_and_mul,
    linear: Callable[[Tensor, Any], Tensor] = F.linear,
    fp32_combine: bool = False,
) -> Tensor:
    """Weighted sum of the chosen gated experts, one GEMM pair per expert that received tokens.

    ``y[t] = sum_j w[t, j] * act(x W13^T) W2^T`` for expert ``e = topk_ids[t, j]``: the routing weight is applied
    late, to each expert's output (in ``x.dtype``, i.e. rounded to it). By default (Kimi Linear, as transformers)
    the weighted output is cast to ``x.dtype`` and accumulated with ``index_add_`` into zeros of ``x.dtype``; with
    ``fp32_combine`` (Kimi K3, model-spec §6) the weighted outputs are summed in fp32 and cast once at the end.

    Args:
        x: ``[T, d]`` tokens.
        w13: ``[E, 2I, d]`` gate and up rows in the order ``act`` expects (default: ``I`` rows of w1, then ``I`` of
            w3), or any stack ``linear`` understands that is indexed per expert (``w13[e]``) and has ``len``, e.g. an
            MXFP4 tensor or a list of packed weights (``ops.linear.pack``).
        w2: ``[E, d, I]`` down projections (same kind as ``w13``).
        topk_weights: ``[T, k]`` combine weights (fp32).
        topk_ids: ``[T, k]`` int expert ids in ``[0, E)``, or -1 for a pair to skip (an expert another
            expert-parallel rank holds: its token gets nothing from it here).
        act: ``[n, 2I] -> [n, I]`` gated activation (default SiLU-GLU).
        linear: ``(x, w13[e]) -> x W^T`` (default ``F.linear``; ``mxfp4_linear`` for MXFP4 weights).
        fp32_combine: sum the weighted expert outputs in fp32.

    Returns:
        ``[T, d]`` in ``x.dtype``.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.long)  # [T*k], token-major
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert; -1 (skipped) first
    token_of_pair = order // top_k
    weight_of_pair = topk_weights.reshape(-1)[order]
    held = flat_ids >= 0
    counts = torch.bincount(flat_ids[held], minlength=len(w13)).tolist()  # host sync: acceptable in the reference

    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32) if fp32_combine else x.dtype)
    start = int(flat_ids.numel() - sum(counts))  # the skipped pairs sort first
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of_pair[start : start + count]
        hidden = act(linear(x[rows], w13[expert]))  # [n, I]
        y = linear(hidden, w2[expert]) * weight_of_pair[start : start + count, None]  # [n, d], promoted
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out.to(x.dtype)
