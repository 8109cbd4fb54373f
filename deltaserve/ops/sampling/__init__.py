"""Token-sampling ops: the only names the runner's sampler calls. Today they are the pure-PyTorch reference."""

from __future__ import annotations

from deltaserve.ops.sampling.ref import (
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k_top_p_min_p,
    compute_logprobs,
    gather_logprobs,
    random_sample,
    token_counts,
)

__all__ = [
    "apply_penalties",
    "apply_temperature",
    "apply_token_bitmask",
    "apply_top_k_top_p_min_p",
    "compute_logprobs",
    "gather_logprobs",
    "random_sample",
    "token_counts",
]
