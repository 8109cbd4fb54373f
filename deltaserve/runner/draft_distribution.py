"""How a drafter turns its logits into draft tokens: the distribution q a sampled draft is drawn from, and the seed
of a request's draft generator. Shared by the draft-model proposer and the block drafter."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.ops import sampling as sampling_ops
from deltaserve.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
"""Multiplier that turns a request's seed into its draft generator's seed (a different stream than the target's)."""


def draft_seed(seed: int) -> int:
    """The seed of the draft generator of a request (or engine) of seed `seed`: never the target's stream."""
    return (seed * _SEED_MIX + 0x632BE59BD9B4E019) % (1 << 63)


def draft_distribution(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """q = softmax of the tempered logits ``[n, V]``, filtered by each row's top_k / top_p / min_p. (Penalties, logit
    bias and allowed / banned tokens are left to the target: any q is valid for rejection sampling as long as the
    token is drawn from the q returned.)"""
    device = logits.device
    logits = sampling_ops.apply_temperature(
        logits.float(), torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device))
    if any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        logits = sampling_ops.apply_top_k_top_p_min_p(
            logits, torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
    return logits.softmax(dim=-1)
