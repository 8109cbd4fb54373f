"""`deltaserve bench memory-plan`: what one rank of a parallel deployment holds, computed by building that rank's
model on PyTorch's meta device (every tensor's shape and dtype, no memory) and running the cache planner on what
the accelerator has left.

Weights per rank are counted from the rank's tensors (its TP slices, its experts, MXFP4 stacks as stored); the KV
bytes per token and state bytes per sequence come from the rank's cache specs; the planner then splits the memory
left after weights and an activation reserve into state slots and KV blocks as the engine would. `--arch kimi-k3`
uses Kimi K3's published config (model-spec §1.3: 93 layers, 896 experts of 3072, MXFP4 routed experts).
`--expert-parallel-size` above the tensor-parallel size plans an expert-parallel group spanning data-parallel
replicas (TP8 x DP2 x EP16, as `--data-parallel-size 2 --enable-expert-parallel` runs it): the rank's experts are
then its share of that group, measured from its tensors like the rest.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

K3_SPEC = dict(arch="kimi_k3", layers=93, hidden=7168, vocab=163840, intermediate=33792, moe_intermediate=3072,
               experts=896, top_k=16, shared_experts=2, num_expert_group=1, topk_group=1, kda_heads=96,
               kda_head_dim=128, mla_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, first_k_dense=1, latent_size=3584, attn_res_block_size=12,
               routed_scaling_factor=1.0)
"""Kimi K3's text config (model-spec §1.3) in `TinySpec` fields; MLA at layers 4, 8, ..., 92 and 93."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlanArgs:
    """The deployment to plan."""

    arch: str = "kimi-k3"
    """'kimi-k3' (the published config) or a checkpoint directory (its config.json only)."""
    tensor_parallel_size: int = 8
    """Ranks the attention and dense weights are split over."""
    enable_expert_parallel: bool = False
    """Routed experts partitioned whole over the ranks instead of split in width."""
    expert_parallel_size: int | None = None
    """Ranks the routed experts are partitioned over (default: tensor_parallel_size; larger spans DP replicas)."""
    data_parallel_size: int = 1
    """Replicas (for the totals)."""
    gpu_memory_gib: float = 288.0
    """Accelerator memory per rank, GiB as the vendor counts it (GB = 1e9 bytes; B300: 288, B200: 192)."""
    gpu_memory_utilization: float = 0.9
    """Share of it the engine may use (vLLM's default)."""
    activation_reserve_gib: float = 8.0
    """Memory kept for activations and workspaces (GB)."""
    max_num_seqs: int = 256
    """Sequences the planner sizes state slots for."""
    context_tokens: str = "131072,1048576"
    """Context lengths to report the concurrent sequences at (comma-separated)."""
    dtype: str = "bfloat16"
    """Dense weights and KV cache dtype."""
    result_file: str | None = None
    """Write the results as JSON here."""


def rank_model(args: MemoryPlanArgs) -> Any:
    """Rank 0's model on the meta device."""
    import torch

    from deltaserve.config import ModelConfig
    from deltaserve.distributed import ParallelGroup
    from deltaserve.distributed.replica_experts import ReplicaExperts
    from deltaserve.models.registry import model_class

    if args.arch == "kimi-k3":
        from deltaserve.models.tiny_k3 import tiny_k3_config_dict
        from deltaserve.models.tiny_spec import TinySpec

        ids = {"bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}
        config = ModelConfig.from_dict(tiny_k3_config_dict(TinySpec(**K3_SPEC), ids))  # type: ignore[arg-type]
    else:
        config = ModelConfig.from_pretrained(args.arch)
    tp_size = args.tensor_parallel_size
    tp = ParallelGroup(rank=0, size=tp_size)  # shapes only: no collective runs
    ep = args.expert_parallel_size or tp_size
    replicas = None
    if args.enable_expert_parallel and ep != tp_size:
        if ep % tp_size:
            raise SystemExit(f"--expert-parallel-size {ep} is not a multiple of --tensor-parallel-size {tp_size}")
        replicas = ReplicaExperts(ep=ParallelGroup(rank=0, size=ep), replica=0, replicas=ep // tp_size,
                                  tp_size=tp_size)
    with torch.device("meta"):
        return model_class(config)(config, dtype=getattr(torch, args.dtype), tp=tp,
                                   expert_parallel=args.enable_expert_parallel, replicas=replicas)


def run(args: MemoryPlanArgs) -> dict[str, Any]:
    from deltaserve.cache.planner import plan_cache
    from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec

    model = rank_model(args)
    expert_bytes = other_bytes = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".mlp.w13" in name or ".mlp.w2" in name:
            expert_bytes += nbytes
        else:
            other_bytes += nbytes
    tp = args.tensor_parallel_size
    ep = args.expert_parallel_size or (tp if args.enable_expert_parallel else 1)
    weights = expert_bytes + other_bytes
    specs = model.cache_specs()
    kv_per_token = sum(s.bytes_per_token for s in specs if isinstance(s, KVCacheSpec))
    state_per_seq = sum(s.bytes_per_slot for s in specs if isinstance(s, StateCacheSpec))
    usable = int(args.gpu_memory_gib * 1e9 * args.gpu_memory_utilization - args.activation_reserve_gib * 1e9)
    budget = usable - weights
    if budget <= 0:
        raise SystemExit(f"weights ({weights / 1e9:.1f} GB per rank) exceed the usable memory "
                         f"({usable / 1e9:.1f} GB): more ranks or expert parallelism needed")
    layout = plan_cache(specs, budget_bytes=budget, block_size=16, max_num_seqs=args.max_num_seqs)
    contexts = [int(c) for c in args.context_tokens.split(",")]
    sequences = {c: budget // (c * kv_per_token + state_per_seq) for c in contexts}
    world = tp * args.data_parallel_size
    result = {
        "args": asdict(args), "ranks": world, "expert_parallel_size": ep,
        "weights_per_rank_gb": weights / 1e9, "routed_expert_gb_per_rank": expert_bytes / 1e9,
        "other_weights_gb_per_rank": other_bytes / 1e9, "weights_all_ranks_tb": weights * world / 1e12,
        "kv_bytes_per_token_per_rank": kv_per_token, "state_mib_per_sequence_per_rank": state_per_seq / 2**20,
        "cache_budget_gb_per_rank": budget / 1e9, "planner_state_slots": layout.num_slots,
        "planner_kv_tokens": layout.num_blocks * layout.block_size,
        "sequences_at_context": sequences,
    }
    print(f"{world} ranks (TP{tp}{f' x DP{args.data_parallel_size}' if args.data_parallel_size > 1 else ''}"
          f"{f' x EP{ep}' if args.enable_expert_parallel else ''}), {args.gpu_memory_gib:g} GB each:")
    print(f"  weights per rank     {weights / 1e9:8.1f} GB  (routed experts {expert_bytes / 1e9:.1f}, "
          f"the rest {other_bytes / 1e9:.1f}); all ranks {weights * world / 1e12:.2f} TB")
    print(f"  cache budget         {budget / 1e9:8.1f} GB  (x{args.gpu_memory_utilization:g} of memory, less "
          f"{args.activation_reserve_gib:g} GB activations, less weights)")
    print(f"  per token            {kv_per_token:8d} B of MLA KV; per sequence {state_per_seq / 2**20:.1f} MiB of "
          "KDA state (recurrent + conv)")
    print(f"  planner              {layout.num_slots} state slots, {layout.num_blocks * 16:,} KV tokens")
    for c, n in sequences.items():
        print(f"  at {c:>9,} tokens   {n:6d} concurrent sequences per replica")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("memory-plan", help="per-rank weights and cache of a TP / EP / DP deployment (meta device)")
    add_dataclass_args(p, MemoryPlanArgs)
    p.set_defaults(func=lambda a: (run(dataclass_from_args(MemoryPlanArgs, a)), 0)[1])
