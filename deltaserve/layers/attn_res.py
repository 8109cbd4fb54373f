"""Block Attention Residuals (Kimi K3, model-spec §7): the learned pseudo-queries and the per-forward block state.

Each decoder layer's mixer input and FFN input, and the model's final output, is a softmax-weighted mix over depth
(for the same token) of the embedding, one sum per completed block of `block_size` decoder layers, and the running
partial sum of the current block.

State: **none across tokens or decode steps**; a decode step needs only the KDA and MLA caches. Within one forward,
`BlockAttnRes` holds ceil(L / block_size) snapshots of ``[T, d]`` in the activation dtype plus the running partial:
for K3 (L = 93, block size 12, d = 7168) 8 snapshots, 57,344 values (112 KiB in bf16) per token of the step, i.e.
1.75 GiB for a 16K-token prefill chunk, plus the transients of one mix (at most three fp32 ``[T, d]`` tensors:
84 KiB per token, 1.3 GiB at 16K tokens). The scheduler's token budget bounds both, as it bounds every activation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deltaserve.ops.attn_res import attn_res_mix


class AttnResWeights(nn.Module):
    """The pseudo-query of one mix: an RMSNorm weight ``[d]`` and a projection ``[1, d]`` (no 1/sqrt(d) scale)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.proj = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """`{prefix}_norm.weight`, `{prefix}_proj.weight` (prefix e.g. "self_attention_res", "mlp_res")."""
        return {f"{prefix}_norm.weight": self.norm, f"{prefix}_proj.weight": self.proj}


class BlockAttnRes:
    """The sources of one forward pass (model-spec §7.2); not a module, it lives for one `forward` call.

    Per decoder layer ``l`` (0-based) the model calls `layer_input` (the mixer's input; the current partial block
    becomes a snapshot when ``l % block_size == 0``, so layer 0 snapshots the embedding), `add` (the mixer output),
    `mix` (the FFN's input) and `add` (the FFN output); after the last layer `mix` with the output weights gives the
    input of the final norm.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int, eps: float) -> None:
        """embedding: ``[T, d]`` token embeddings (the first partial)."""
        if block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {block_size}")
        self.block_size, self.eps = block_size, eps
        num_snapshots = math.ceil(num_layers / block_size)
        self.blocks = embedding.new_empty(num_snapshots, *embedding.shape)  # [n, T, d]
        self.num_blocks = 0
        self.partial: torch.Tensor | None = embedding

    def mix(self, weights: AttnResWeights) -> torch.Tensor:
        """``[T, d]``: the mix over the completed blocks and the partial block."""
        return attn_res_mix(self.blocks[: self.num_blocks], self.partial, weights.norm, weights.proj, self.eps)

    def layer_input(self, layer_id: int, weights: AttnResWeights) -> torch.Tensor:
        """The input of layer ``layer_id``'s mixer (before its input norm); starts a new block at a boundary."""
        if self.num_blocks == 0:
            assert self.partial is not None, "partial is only cleared when a block completes"
            h = self.partial
        else:
            h = self.mix(weights)
        if layer_id % self.block_size == 0:
            if self.partial is None or self.num_blocks == self.blocks.shape[0]:
                raise RuntimeError(f"layer {layer_id} starts a block out of order")
            self.blocks[self.num_blocks] = self.partial
            self.num_blocks += 1
            self.partial = None
        return h

    def add(self, out: torch.Tensor) -> None:
        """Add a sub-layer's output to the partial block."""
        self.partial = out if self.partial is None else self.partial + out
