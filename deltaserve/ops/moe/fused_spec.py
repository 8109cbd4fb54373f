"""What the fused Triton MoE (`triton_moe.py`) needs to know of a `moe_experts` call's `act` and `linear`, read
without importing triton (the dispatcher asks `supports` on every call): the gated activation (SiLU-GLU, or K3's
SiTU with its betas), whether gate and up rows are interleaved, and whether the expert stacks are dense or MXFP4."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul, situ_and_mul
from deltaserve.ops.mxfp4 import mxfp4_linear


@dataclass(frozen=True, slots=True)
class FusedAct:
    """A gated activation the kernel computes itself: ``situ`` False is SiLU(g) * u."""

    situ: bool = False
    beta: float = 0.0
    linear_beta: float | None = None
    interleaved: bool = False
    """Gate ``j`` is row ``2j`` and up ``j`` row ``2j + 1`` of w13 (else the gate rows, then the up rows)."""


def fused_act(act: Callable[[Tensor], Tensor]) -> FusedAct | None:
    """The activation as the kernel knows it, or None for one it does not."""
    if act is silu_and_mul:
        return FusedAct()
    if isinstance(act, functools.partial) and act.func is situ_and_mul and not act.args:
        kw = act.keywords
        if set(kw) <= {"beta", "linear_beta", "interleaved"} and "beta" in kw:
            return FusedAct(situ=True, beta=float(kw["beta"]), linear_beta=kw.get("linear_beta"),
                            interleaved=bool(kw.get("interleaved", False)))
    return None


def weight_format(linear: Callable[[Tensor, Any], Tensor]) -> str | None:
    """'dense' for `F.linear`, 'mxfp4' for `mxfp4_linear` with bf16 / fp32 activations (MXFP8 activation rounding is
    the reference's), None otherwise."""
    if linear is F.linear:
        return "dense"
    if linear is mxfp4_linear:
        return "mxfp4"
    if (isinstance(linear, functools.partial) and linear.func is mxfp4_linear and not linear.args
            and not linear.keywords.get("mxfp8_activations", False) and set(linear.keywords) <= {"mxfp8_activations"}):
        return "mxfp4"
    return None
