"""One MoonViT encoder block: pre-norm attention with 2D rotary embedding within each image, then a pre-norm MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaserve.config.vision import VisionConfig
from deltaserve.ops.vision import apply_rope_2d, varlen_attention

LAYER_NORM_EPS = 1e-5
"""MoonViT's block and final LayerNorms (fixed, not in the config)."""


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, as checkpoint tensors."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        return {"weight": self.weight, "bias": self.bias}

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Linear(nn.Module):
    """A linear map with bias (the tower's projections all have one)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        return {"weight": self.weight, "bias": self.bias}

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionEncoderBlock(nn.Module):
    """``x + wo(attn(rope(wqkv(norm0 x))))``, then ``x + fc1(act(fc0(norm1 x)))``. `wqkv` holds q, k and v rows in
    that order, each head's channels in the interleaved (even, odd) rotary layout of the checkpoint."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        self.norm0 = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.norm1 = LayerNorm(d, LAYER_NORM_EPS, dtype)
        self.wqkv = Linear(d, 3 * d, dtype)
        self.wo = Linear(d, d, dtype)
        self.fc0 = Linear(d, config.intermediate_size, dtype)
        self.fc1 = Linear(config.intermediate_size, d, dtype)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        named: dict[str, Tensor] = {}
        for prefix, module in (("norm0", self.norm0), ("norm1", self.norm1), ("wqkv", self.wqkv), ("wo", self.wo),
                               ("mlp.fc0", self.fc0), ("mlp.fc1", self.fc1)):
            named.update({f"{prefix}.{k}": v for k, v in module.checkpoint_tensors().items()})
        return named

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Sequence[int]) -> Tensor:
        """x: ``[n, D]``; cos, sin: ``[n, head_dim // 2]``; cu_seqlens: one segment per image."""
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        attn = varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)
        x = x + self.wo(attn.flatten(1))
        return x + self.fc1(F.gelu(self.fc0(self.norm1(x)), approximate=self.approximate))
