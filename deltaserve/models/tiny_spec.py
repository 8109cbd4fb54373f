"""The sizes of a tiny random checkpoint (`TinySpec`), apart from the writer so that the command line can build its
arguments without importing torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaserve.config.fields import check_field_types


@dataclass(frozen=True, slots=True, kw_only=True)
class TinySpec:
    """Sizes of a tiny checkpoint (defaults: model-spec §13.1)."""

    layers: int = 8
    """Decoder layers; every 4th (1-based) and the last are MLA, the rest KDA."""
    hidden: int = 256
    vocab: int = 1024
    intermediate: int = 512
    moe_intermediate: int = 128
    experts: int = 8
    top_k: int = 2
    shared_experts: int = 1
    num_expert_group: int = 2
    topk_group: int = 1
    kda_heads: int = 4
    kda_head_dim: int = 32
    mla_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    first_k_dense: int = 1
    routed_scaling_factor: float = 2.446
    seed: int = 0
    dense_name: str = "mlp"
    """Name of the dense FFN tensors: "mlp" (real checkpoints) or "block_sparse_moe" (transformers' save)."""
    shard_bytes: int = 0
    """Split the weights into shards of about this size with an index file; 0 writes one file."""
    arch: str = "kimi_linear"
    """"kimi_linear", or "kimi_k3": nested text_config, bounded KDA gate, gated MLA, SiTU LatentMoE with MXFP4
    experts, Block AttnRes, XTML special tokens (the other sizes apply; K3 itself has q-LoRA and 2 shared experts)."""
    latent_size: int = 128
    """kimi_k3: LatentMoE latent width (routed_expert_hidden_size), a multiple of 32."""
    attn_res_block_size: int | None = 3
    """kimi_k3: decoder layers per Block AttnRes block; none for plain residuals."""
    expert_format: str = "compressed-tensors"
    """kimi_k3: routed experts in MXFP4, "compressed-tensors" (K3's layout) or "gpt-oss", or "dense"."""
    vision: bool = False
    """Add a tiny vision tower and projector (`vision_tower.*`, `mm_projector.*`, models/tiny_vision.py); a Kimi
    Linear checkpoint's tokenizer then ends with the four media tokens."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor}")
        if self.shard_bytes < 0:
            raise ValueError(f"shard_bytes must be >= 0 (0 writes one file), got {self.shard_bytes}")


LONG_CONTEXT = TinySpec(
    layers=4, hidden=64, kda_heads=2, kda_head_dim=16, mla_heads=1, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=16, experts=4, top_k=2, num_expert_group=1, topk_group=1, intermediate=128,
    moe_intermediate=32, seed=6,
)
"""The smallest Kimi Linear shape that keeps every part: 3 KDA layers and 1 MLA layer of one head (a 1.2 MB
checkpoint). MLA attention is the one cost that grows with the context (quadratic in it); here it is as small as it
can be, so that a 1M-token prompt prefills in minutes on a CPU (scripts/long_prompt_bench.py --spec long-context,
the slow tests of tests/engine/test_long_prompt.py)."""
