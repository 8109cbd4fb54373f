"""Token-sampling ops: the only names the runner's sampler calls, dispatched (today only the pure-PyTorch
reference)."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.sampling import ref

token_counts = dispatch.op("token_counts", ref.token_counts)
apply_penalties = dispatch.op("apply_penalties", ref.apply_penalties)
apply_token_bitmask = dispatch.op("apply_token_bitmask", ref.apply_token_bitmask)
apply_temperature = dispatch.op("apply_temperature", ref.apply_temperature)
apply_top_k_top_p_min_p = dispatch.op("apply_top_k_top_p_min_p", ref.apply_top_k_top_p_min_p)
random_sample = dispatch.op("random_sample", ref.random_sample)
rejection_sample = dispatch.op("rejection_sample", ref.rejection_sample)
block_rejection_sample = dispatch.op("block_rejection_sample", ref.block_rejection_sample)
compute_logprobs = dispatch.op("compute_logprobs", ref.compute_logprobs)
gather_logprobs = dispatch.op("gather_logprobs", ref.gather_logprobs)

__all__ = [
    "apply_penalties",
    "apply_temperature",
    "apply_token_bitmask",
    "apply_top_k_top_p_min_p",
    "block_rejection_sample",
    "compute_logprobs",
    "gather_logprobs",
    "random_sample",
    "rejection_sample",
    "token_counts",
]
