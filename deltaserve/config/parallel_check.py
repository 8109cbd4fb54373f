"""Whether a model can be split the way a `ParallelConfig` asks, checked in the engine process before any worker
starts: a split that does not divide is a one-line error naming the config field, not a worker's traceback."""

from __future__ import annotations

from deltaserve.config.engine import ParallelConfig
from deltaserve.config.model import ModelConfig

MXFP4_BLOCK = 32
"""Values per MXFP4 scale: a tensor-parallel slice of an MXFP4 expert keeps whole blocks."""


def check_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """ValueError naming the first model field that `tensor_parallel_size` (or the expert-parallel size) does not
    divide: KDA and MLA heads, the dense and expert widths, the routed experts."""
    tp = parallel.tensor_parallel_size
    if parallel.num_redundant_experts > model.moe.num_experts:
        raise ValueError(f"num_redundant_experts={parallel.num_redundant_experts} exceeds n_routed_experts="
                         f"{model.moe.num_experts}")
    if tp > 1:
        _check_tensor_parallel(model, parallel)
    ep = parallel.expert_parallel_size
    physical = model.moe.num_experts + parallel.num_redundant_experts
    if ep > 1 and physical % ep:
        named = "n_routed_experts" + (" + num_redundant_experts" if parallel.num_redundant_experts else "")
        over = f"tensor_parallel_size={tp}" + (f" x data_parallel_size={ep // tp}" if ep != tp else "")
        raise ValueError(f"{named}={physical} is not divisible by the expert-parallel size {ep} ({over})")


def _check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    tp = parallel.tensor_parallel_size
    kinds = set(model.layer_kinds)
    checks = [("linear_attn_config.num_heads", model.kda.num_heads, "kda" in kinds),
              ("num_attention_heads", model.mla.num_heads, "mla" in kinds),
              ("intermediate_size", model.intermediate_size, model.first_k_dense_replace > 0),
              ("moe_intermediate_size (shared experts)",
               model.moe.intermediate_size * model.moe.num_shared_experts, model.moe.num_shared_experts > 0)]
    if not parallel.enable_expert_parallel:
        checks.append(("moe_intermediate_size", model.moe.intermediate_size, True))
    for name, value, used in checks:
        if used and value % tp:
            raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")
    per_rank = model.moe.intermediate_size // tp
    if model.quantization is not None and not parallel.enable_expert_parallel and per_rank % MXFP4_BLOCK:
        raise ValueError(f"moe_intermediate_size={model.moe.intermediate_size} over tensor_parallel_size={tp} is "
                         f"{per_rank} per rank, not a multiple of the MXFP4 block ({MXFP4_BLOCK}): use "
                         "--enable-expert-parallel or fewer ranks")
