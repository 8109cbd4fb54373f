"""Reference dense linear: ``y = x W^T`` with ``W [out, in]`` a plain tensor or one pre-packed by `onednn.pack`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., in] @ weight^T -> [..., out]`` in ``x.dtype``; a packed weight (oneDNN's blocked layout, see
    `onednn.pack`) is unpacked first (slow: the reference is the oracle, not a path anyone should take)."""
    return F.linear(x, weight.to_dense() if weight.is_mkldnn else weight)
