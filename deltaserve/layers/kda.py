"""Kimi Delta Attention layer: q/k/v projections, short conv, decay gate, beta, KDA op, gated norm, output."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import KDAConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard, shard_range, split_along
from deltaserve.layers.forward_batch import ForwardBatch, KDALayerCache
from deltaserve.layers.linear import FusedLinear, Linear, NormWeight
from deltaserve.ops.kda import kda_decode, kda_gate, kda_prefill, kda_verify
from deltaserve.ops.norm import gated_rms_norm
from deltaserve.ops.short_conv import short_conv_decode, short_conv_prefill, short_conv_verify

PREFILL_CHUNK = 16
"""Chunk length of the chunked prefill. On CPU 16 beat 64 by 20-25% for batches of many prompts (32 x 256 tokens:
145 vs 188 ms per layer call, 1 thread) and tied for one long prompt; smaller chunks also keep the in-chunk decay
exponents small."""


class KDAttention(nn.Module):
    """One KDA mixer (model-spec §3). Decode rows use the recurrent form, prefill rows the chunked form."""

    def __init__(self, cfg: KDAConfig, hidden_size: int, rms_norm_eps: float, layer_id: int, dtype: torch.dtype, *,
                 a_log_size: int | None = None, k3_precision: bool = False, tp: ParallelGroup = SINGLE):
        """`a_log_size`: None stores `A_log` as [1, 1, H, 1] (Kimi Linear); an int stores a flat vector of that
        size whose first H entries are used (K3: H rounded up to 128, zero-padded). `k3_precision`: the conv and
        `o_norm` weights stay fp32 whatever `dtype` (K3 stores them in fp32, so its conv runs in fp32) and beta's
        sigmoid is taken in fp32 (NeMo's K3; transformers' Kimi Linear takes it in the model dtype). `tp`: this rank
        holds `num_heads / tp.size` heads (their projections, conv channels, gate parameters and recurrent state);
        the low-rank gate inputs (f_a, g_a) are whole on every rank and o_proj's partial outputs are summed."""
        super().__init__()
        self.cfg, self.eps, self.layer_id, self.k3_precision, self.tp = cfg, rms_norm_eps, layer_id, k3_precision, tp
        self.head_start, h = shard_range(cfg.num_heads, tp.rank, tp.size, "linear_attn_config.num_heads")
        self.num_heads, dh = h, cfg.head_dim
        self.proj_dim = p = h * dh
        full_p = cfg.proj_dim
        # Every projection that reads x is one GEMM: q, k, v, the decay-gate input, beta and the output gate.
        gate = [("g_proj", full_p)] if cfg.use_full_rank_gate else [("g_a_proj", dh)]
        self.in_proj = FusedLinear(
            hidden_size, [("q_proj", full_p), ("k_proj", full_p), ("v_proj", full_p), ("f_a_proj", dh),
                          ("b_proj", cfg.num_heads), *gate], dtype,
            tp=tp, sharded=frozenset({"q_proj", "k_proj", "v_proj", "b_proj", "g_proj"}),
        )
        # Kept as three checkpoint tensors [P, 1, K]; concatenated per step (tiny) so conv state is one window.
        conv_dtype = torch.float32 if k3_precision else dtype
        self.q_conv1d = nn.Parameter(torch.empty(p, 1, cfg.conv_kernel_size, dtype=conv_dtype), requires_grad=False)
        self.k_conv1d = nn.Parameter(torch.empty(p, 1, cfg.conv_kernel_size, dtype=conv_dtype), requires_grad=False)
        self.v_conv1d = nn.Parameter(torch.empty(p, 1, cfg.conv_kernel_size, dtype=conv_dtype), requires_grad=False)
        self.f_b_proj = Linear(dh, full_p, dtype, tp=tp, parallel="column")
        # The decay-gate parameters stay fp32 whatever the model dtype (they feed exp/softplus). A rank holds its
        # heads' entries of A_log (K3's padded vector: the first H entries are the heads).
        self.a_log_full_shape = (1, 1, cfg.num_heads, 1) if a_log_size is None else (a_log_size,)
        a_log_shape = (1, 1, h, 1) if a_log_size is None else (a_log_size if tp.size == 1 else h,)
        self.A_log = nn.Parameter(torch.empty(*a_log_shape, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(p, dtype=torch.float32), requires_grad=False)
        if not cfg.use_full_rank_gate:
            self.g_b_proj = Linear(dh, full_p, dtype, tp=tp, parallel="column")
        self.o_norm = NormWeight(dh, conv_dtype)
        self.o_proj = Linear(full_p, hidden_size, dtype, tp=tp, parallel="row")

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard]:
        # In the order the tiny checkpoints draw their random values (changing it changes every test model).
        tp, full_p = self.tp, self.cfg.proj_dim
        a_dim = 2 if len(self.a_log_full_shape) == 4 else 0  # [1, 1, H, 1] or K3's flat [128]
        named: dict[str, torch.Tensor | Shard] = {
            "A_log": self.A_log if tp.size == 1 else Shard(self.A_log, a_dim, self.head_start,
                                                           self.a_log_full_shape[a_dim]),
            "dt_bias": split_along(self.dt_bias, 0, full_p, tp.rank, tp.size),
            "f_b_proj.weight": self.f_b_proj.checkpoint_tensors()["weight"],
        }
        if not self.cfg.use_full_rank_gate:
            named["g_b_proj.weight"] = self.g_b_proj.checkpoint_tensors()["weight"]
        named["o_norm.weight"] = self.o_norm.weight
        named["o_proj.weight"] = self.o_proj.checkpoint_tensors()["weight"]
        for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
            named[f"{conv}.weight"] = split_along(getattr(self, conv), 0, full_p, tp.rank, tp.size)
        named.update(self.in_proj.checkpoint_tensors())
        return named

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache) -> torch.Tensor:
        """x: [T, d] (after input_layernorm) -> [T, d]."""
        cfg, nd, nr, h = self.cfg, batch.num_decodes, batch.num_decode_rows, self.num_heads
        t = x.shape[0]
        *qkv, f_a, b, gate = self.in_proj(x)
        mixed = torch.cat(qkv, dim=-1)  # [T, 3P] pre-conv
        conv_w = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d]).squeeze(1)  # [3P, K]
        # The prefill ops also write the checkpoints the batch asks for (conv windows, then recurrent states).
        ckpt_pos, ckpt_slots = batch.checkpoint_positions, batch.checkpoint_slots
        parts = []
        decode_slots = batch.decode_slot_range if batch.decode_slot_range is not None else batch.state_indices[:nd]
        verify = (batch.state_indices[nd:batch.num_decode_like], batch.verify_cu_seqlens_host(),
                  batch.verify_scratch_slots)
        if nd:
            parts.append(short_conv_decode(mixed[:nd], conv_w, cache.conv, decode_slots))
        if batch.num_verifies:
            parts.append(short_conv_verify(mixed[nd:nr], conv_w, cache.conv, *verify))
        if nr < t:
            parts.append(
                short_conv_prefill(
                    mixed[nr:], conv_w, cache.conv, batch.state_indices[batch.num_decode_like:],
                    batch.prefill_cu_seqlens_host(),
                    checkpoint_positions=ckpt_pos, checkpoint_slots=ckpt_slots,
                )
            )
        mixed = parts[0] if len(parts) == 1 else torch.cat(parts)
        q, k, v = (m.reshape(t, h, cfg.head_dim) for m in mixed.split(self.proj_dim, dim=-1))
        f = self.f_b_proj(f_a).view(t, h, cfg.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias, cfg.gate_lower_bound)  # [T, H, Dh] fp32
        if self.k3_precision:  # sigmoid in (at least) fp32
            beta = torch.sigmoid(b.to(torch.promote_types(b.dtype, torch.float32)))  # [T, H]
        else:
            beta = torch.sigmoid(b).to(torch.promote_types(b.dtype, torch.float32))  # [T, H]; fp64 model: fp64
        outs = []
        if nd:
            outs.append(kda_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], cache.state, decode_slots))
        if batch.num_verifies:
            outs.append(kda_verify(q[nd:nr], k[nd:nr], v[nd:nr], g[nd:nr], beta[nd:nr], cache.state, *verify))
        if nr < t:
            outs.append(
                kda_prefill(
                    q[nr:], k[nr:], v[nr:], g[nr:], beta[nr:], cache.state, batch.state_indices[batch.num_decode_like:],
                    batch.prefill_cu_seqlens_host(), checkpoint_positions=ckpt_pos, checkpoint_slots=ckpt_slots,
                    chunk_size=PREFILL_CHUNK,
                )
            )
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, Dh]
        if not cfg.use_full_rank_gate:
            gate = self.g_b_proj(gate)
        o = gated_rms_norm(o, gate.view(t, h, cfg.head_dim), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(t, self.proj_dim))

