"""Definitional (Full and Block) Attention Residuals for tests, written from model-spec §7 independently of
`deltaserve.layers.attn_res` / `deltaserve.ops.attn_res`: sources are rebuilt from every layer's outputs each time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Sublayer = Callable[[torch.Tensor], torch.Tensor]
Weights = tuple[torch.Tensor, torch.Tensor]  # (norm [d], proj [1, d])


def mix_formula(sources: Sequence[torch.Tensor], weights: Weights, eps: float) -> torch.Tensor:
    """softmax over sources j of sum_c rows_j[c] * rsqrt(mean(rows_j^2) + eps) * norm[c] * proj[0, c], mixing the raw
    rows; in fp64, cast back to the sources' dtype."""
    norm, proj = weights
    rows = torch.stack([s.double() for s in sources])  # [n, T, d]
    keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    probs = (keys * proj.double().reshape(-1)).sum(-1).softmax(0)  # [n, T]
    return (probs.unsqueeze(-1) * rows).sum(0).to(sources[0].dtype)


def block_attn_res(embedding: torch.Tensor, layers: Sequence[tuple[Sublayer, Sublayer, Weights, Weights]],
                   output_weights: Weights, block_size: int, eps: float) -> torch.Tensor:
    """Block AttnRes by definition: the input of layer l's mixer mixes the embedding, the sum of the outputs of every
    completed block before l's block, and (if not empty) the sum of the outputs of l's block so far; the FFN input
    adds l's mixer output to that last source; the final output mixes the embedding, the completed blocks and the
    last block. Returns the input of the final norm."""
    outs: list[torch.Tensor] = []  # a_l + m_l of every finished layer

    def completed(block: int) -> list[torch.Tensor]:
        return [embedding] + [torch.stack(outs[j * block_size : (j + 1) * block_size]).sum(0) for j in range(block)]

    for layer, (mixer, ffn, attn_w, mlp_w) in enumerate(layers):
        block = layer // block_size
        current = outs[block * block_size : layer]
        before = completed(block)
        a = mixer(mix_formula(before + ([torch.stack(current).sum(0)] if current else []), attn_w, eps))
        m = ffn(mix_formula(before + [torch.stack([*current, a]).sum(0)], mlp_w, eps))
        outs.append(a + m)
    last = (len(layers) - 1) // block_size
    return mix_formula(completed(last) + [torch.stack(outs[last * block_size :]).sum(0)], output_weights, eps)


def full_attn_res(embedding: torch.Tensor, layers: Sequence[tuple[Sublayer, Sublayer, Weights, Weights]],
                  output_weights: Weights, eps: float) -> torch.Tensor:
    """Full AttnRes over decoder layers: every input mixes the embedding and every earlier layer's output (the FFN
    also its own layer's mixer output)."""
    outs: list[torch.Tensor] = []
    for mixer, ffn, attn_w, mlp_w in layers:
        a = mixer(mix_formula([embedding, *outs], attn_w, eps))
        m = ffn(mix_formula([embedding, *outs, a], mlp_w, eps))
        outs.append(a + m)
    return mix_formula([embedding, *outs], output_weights, eps)
