"""Multi-head latent attention (NoPE) layer over a paged latent cache: expanded prefill, absorbed decode (the layer
absorbs `kv_b` into the query and the output; the decode op is pure latent attention)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import MLAConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard, shard_range
from deltaserve.layers.forward_batch import ForwardBatch, MLALayerCache
from deltaserve.layers.linear import FusedLinear, Linear, NormWeight
from deltaserve.ops.mla import mla_decode, mla_prefill, mla_write_cache
from deltaserve.ops.norm import rms_norm

# transformers and NeMo use the module default 1e-6 here, not rms_norm_eps (model-spec §2.2).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """One MLA mixer (model-spec §4). Caches [c ; kr] (R + Dr values) per token."""

    def __init__(self, cfg: MLAConfig, hidden_size: int, dtype: torch.dtype, *, tp: ParallelGroup = SINGLE) -> None:
        """`tp`: this rank holds `num_heads / tp.size` heads (their query, `kv_b`, gate and output columns); the
        latent projection, its norm and so the latent cache are whole on every rank (one latent row serves every
        head: sharding it would need a gather per layer), and o_proj's partial outputs are summed."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.num_heads = h = shard_range(cfg.num_heads, tp.rank, tp.size, "num_attention_heads")[1]
        q_out = cfg.num_heads * cfg.qk_head_dim
        # The query projection (or its LoRA down-projection) and the latent projection are one GEMM.
        q_part = ("q_proj", q_out) if cfg.q_lora_rank is None else ("q_a_proj", cfg.q_lora_rank)
        self.in_proj = FusedLinear(hidden_size, [q_part, ("kv_a_proj_with_mqa", cfg.cache_row_width)], dtype,
                                   tp=tp, sharded=frozenset({"q_proj"}))
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = NormWeight(cfg.q_lora_rank, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, dtype, tp=tp, parallel="column")
        self.kv_a_layernorm = NormWeight(cfg.kv_lora_rank, dtype)
        # Read directly (absorbed into the decode query and output, split for the prefill): never packed.
        self.kv_b_proj = Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                                packable=False, tp=tp, parallel="column")
        if cfg.use_output_gate:
            self.g_proj = Linear(hidden_size, cfg.num_heads * cfg.v_head_dim, dtype, tp=tp, parallel="column")
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, hidden_size, dtype, tp=tp, parallel="row")
        self.o_width = h * cfg.v_head_dim
        self.scale = cfg.qk_head_dim**-0.5

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard]:
        # In the order the tiny checkpoints draw their random values (changing it changes every test model).
        named: dict[str, torch.Tensor | Shard] = {}
        if self.cfg.q_lora_rank is not None:
            named["q_a_layernorm.weight"] = self.q_a_layernorm.weight
            named["q_b_proj.weight"] = self.q_b_proj.checkpoint_tensors()["weight"]
        named["kv_a_layernorm.weight"] = self.kv_a_layernorm.weight
        named["kv_b_proj.weight"] = self.kv_b_proj.checkpoint_tensors()["weight"]
        if self.cfg.use_output_gate:
            named["g_proj.weight"] = self.g_proj.checkpoint_tensors()["weight"]
        named["o_proj.weight"] = self.o_proj.checkpoint_tensors()["weight"]
        named.update(self.in_proj.checkpoint_tensors())
        return named

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: MLALayerCache) -> torch.Tensor:
        """x: [T, d] (after input_layernorm) -> [T, d]."""
        cfg, nd, nr, t, h = self.cfg, batch.num_decodes, batch.num_decode_rows, x.shape[0], self.num_heads
        q, ckv = self.in_proj(x)
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(rms_norm(q, self.q_a_layernorm.weight, LATENT_NORM_EPS))
        q = q.reshape(t, h, cfg.qk_head_dim)
        c = rms_norm(ckv[:, : cfg.kv_lora_rank], self.kv_a_layernorm.weight, LATENT_NORM_EPS)
        mla_write_cache(torch.cat([c, ckv[:, cfg.kv_lora_rank :]], dim=-1), cache.kv, batch.slot_mapping)
        w = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # [H, Dn, R], [H, Dv, R]
        outs = []
        if nr:  # decode rows, and verify chunks token by token (each a decode query at its own position)
            tables, context_lens = batch.block_tables[:nd], batch.context_lens[:nd]
            if batch.verify_rows is not None and batch.verify_context_lens is not None:
                tables = torch.cat([tables, batch.block_tables[batch.verify_rows]])
                context_lens = torch.cat([context_lens, batch.verify_context_lens])
            outs.append(self._decode(q[:nr], w_uk, w_uv, tables, context_lens, cache))
        if nr < t:
            first = batch.num_decode_like
            outs.append(
                mla_prefill(q[nr:], cache.kv, batch.block_tables[first:], batch.prefill_cu_seqlens(),
                            batch.context_lens[first:], w_uk, w_uv, scale=self.scale,
                            cu_seqlens_host=batch.prefill_cu_seqlens_host(),
                            context_lens_host=batch.context_lens_host[first:] or None)
            )
        o = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(t, self.o_width)
        if cfg.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _decode(self, q: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, cache: MLALayerCache) -> torch.Tensor:
        """Absorbed decode (spec §4.2): q [N, H, Dn+Dr] -> latent query [W_uk^T q_n ; q_r] -> latent attention over
        the cache (query i at position context_lens[i] - 1 of block_tables[i]) -> W_uv -> [N, H, Dv]."""
        dn = self.cfg.qk_nope_head_dim
        w_uk, w_uv = w_uk.to(q.dtype), w_uv.to(q.dtype)
        # Heads as the batch of plain bmm's: at decode sizes einsum's permutes and copies cost more than the products.
        q_nope = torch.bmm(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, R]
        q_latent = torch.cat([q_nope, q[..., dn:]], dim=-1)  # [N, H, R+Dr]
        o_latent = mla_decode(q_latent, cache.kv, block_tables, context_lens,
                              kv_lora_rank=self.cfg.kv_lora_rank, scale=self.scale)  # [N, H, R]
        if q.is_cpu and q.dtype == torch.bfloat16:
            # oneDNN's bf16 bmm copies a transposed operand whose batch stride is not its matrix size (w_uv^T, a slice
            # of kv_b): ~60 us of a ~100 us product at batch 1. The transposed product reads w_uv as it lies (with
            # fp32's BLAS it is the slower form at batch 1).
            return torch.bmm(w_uv, o_latent.permute(1, 2, 0)).permute(2, 0, 1)  # [N, H, Dv]
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [N, H, Dv]
