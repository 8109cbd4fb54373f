"""Token selection from fp32 logits: greedy, temperature, top-k, top-p, each row with its own generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """logits: [N, V] fp32 -> token ids [N] int64. Greedy rows take the argmax; others sample."""
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Drop a token when the mass before it already reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(0)
    return out
