"""RMSNorm and gated RMSNorm (model-spec §2.2, §2.3): the references `ref_*` and the dispatched ops layers call."""

from __future__ import annotations

import torch
from torch import Tensor

from deltaserve.ops import dispatch


def ref_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, as transformers' ``KimiLinearRMSNorm``.

    The normalisation runs in fp32 and is cast back to ``x.dtype`` *before* the weight is applied, so the output dtype
    is ``torch.promote_types(weight.dtype, x.dtype)`` (the same as ``weight * x``).

    Args:
        x: ``[..., D]`` input, any float dtype.
        weight: ``[D]`` scale.
        eps: added to the mean square (1e-5 for the block norms, 1e-6 for the MLA latent norms; spec §2.2).

    Returns:
        ``[..., D]`` tensor, ``weight * cast_to_input_dtype(x32 * rsqrt(mean(x32**2) + eps))``.
    """
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64 (the fp64 oracle must not round)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def ref_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated RMSNorm (KDA output norm), as transformers' ``KimiLinearRMSNormGated``.

    Everything runs in fp32, the weight included; only the final result is cast to ``x.dtype``.

    Args:
        x: ``[..., D]`` input (``D`` is the head dim; one weight is shared by all heads).
        gate: same shape as ``x``; the output is multiplied by ``sigmoid(gate)``.
        weight: ``[D]`` scale, applied in fp32 before the cast.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` tensor in ``x.dtype``: ``w32 * (x32 * rsqrt(mean(x32**2) + eps)) * sigmoid(gate32)``.
    """
    cdt = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (the fp64 oracle)
    x32 = x.to(cdt)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight.to(cdt) * normed * torch.sigmoid(gate.to(cdt))
    return out.to(x.dtype)


rms_norm = dispatch.op("rms_norm", ref_rms_norm)
gated_rms_norm = dispatch.op("gated_rms_norm", ref_gated_rms_norm)
