"""Kimi K3 (`KimiK3ForConditionalGeneration`, its language model): KDA with the bounded decay gate, full-rank
output gate and fp32 conv; gated MLA; LatentMoE with SiTU and MXFP4 routed experts; Block Attention Residuals
(model-spec §1, §3-§7, §9.2, §10). Same layers, ops and cache kinds as Kimi Linear. The vision tower is a separate
part (`kimi_vision.py`); its features reach this model through `ForwardBatch.embed_rows` / `embed_values`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from deltaserve import envs
from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.layers.attn_res import AttnResWeights, BlockAttnRes
from deltaserve.layers.forward_batch import ForwardBatch, LayerCache
from deltaserve.layers.kda import KDAttention
from deltaserve.layers.latent_moe import LatentMoE
from deltaserve.layers.linear import NormWeight, pack_parameter
from deltaserve.layers.mla import MLAttention
from deltaserve.layers.moe import GatedMLP, gated_activation
from deltaserve.layers.vocab import VocabShard
from deltaserve.models.kimi_linear import VISION_PREFIXES, join_idle, layer_cache_specs
from deltaserve.ops.norm import rms_norm

TEXT_PREFIX = "language_model."
"""Every text tensor of a K3 checkpoint carries this prefix (model-spec §9.2)."""
A_LOG_PAD = 128
"""K3 stores `A_log` zero-padded to a multiple of 128 entries (96 heads -> [128], model-spec §3.3)."""
_DENSE_ALIAS = re.compile(r"^(language_model\.model\.layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


class K3DecoderLayer(nn.Module):
    """One decoder layer: a KDA or MLA mixer and a dense SiTU MLP or a LatentMoE, joined by plain residuals or by
    Block AttnRes (`forward_attn_res`)."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, mxfp8_activations: bool,
                 tp: ParallelGroup = SINGLE, expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        super().__init__()
        d, self.eps, self.layer_id = config.hidden_size, config.rms_norm_eps, layer_id
        self.input_layernorm = NormWeight(d, dtype)
        self.post_attention_layernorm = NormWeight(d, dtype)
        if config.layer_kinds[layer_id] == "kda":
            a_log_size = -(-config.kda.num_heads // A_LOG_PAD) * A_LOG_PAD
            self.self_attn: KDAttention | MLAttention = KDAttention(
                # K3 keeps the conv, o_norm and beta in (at least) fp32; an fp64 model (the oracle) runs them in
                # fp64 like everything else, which the plain dtype path does.
                config.kda, d, self.eps, layer_id, dtype, a_log_size=a_log_size, k3_precision=dtype != torch.float64,
                tp=tp,
            )
        else:
            self.self_attn = MLAttention(config.mla, d, dtype, tp=tp)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            self.mlp: LatentMoE | GatedMLP = LatentMoE(config.moe, d, config.activation, self.eps, dtype,
                                                       config.quantization, mxfp8_activations, tp=tp,
                                                       expert_parallel=expert_parallel, eplb=eplb,
                                                       replicas=replicas)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, dtype, act=gated_activation(config.activation), tp=tp)
        self.attn_res = config.attn_res_block_size is not None
        if self.attn_res:
            self.self_attention_res = AttnResWeights(d, dtype)
            self.mlp_res = AttnResWeights(d, dtype)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        named: dict[str, torch.Tensor | Shard | None] = {
            "input_layernorm.weight": self.input_layernorm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        }
        named.update({f"self_attn.{k}": v for k, v in self.self_attn.checkpoint_tensors().items()})
        ffn = "block_sparse_moe" if self.is_moe else "mlp"
        named.update({f"{ffn}.{k}": v for k, v in self.mlp.checkpoint_tensors().items()})
        if self.attn_res:
            named.update(self.self_attention_res.checkpoint_tensors("self_attention_res"))
            named.update(self.mlp_res.checkpoint_tensors("mlp_res"))
        return named

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        """Plain residuals (no `attn_res_block_size`): h += Mixer(norm(h)); h += FFN(norm(h))."""
        h = h + self.self_attn(rms_norm(h, self.input_layernorm.weight, self.eps), batch, cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm.weight, self.eps))

    def forward_attn_res(self, res: BlockAttnRes, batch: ForwardBatch, cache: LayerCache) -> None:
        """Block AttnRes (model-spec §7.2): both sub-layers read a mix over depth and add to the partial block."""
        h = res.layer_input(self.layer_id, self.self_attention_res)
        res.add(self.self_attn(rms_norm(h, self.input_layernorm.weight, self.eps), batch, cache))
        res.add(self.mlp(rms_norm(res.mix(self.mlp_res), self.post_attention_layernorm.weight, self.eps)))


class KimiK3ForConditionalGeneration(nn.Module):
    """The K3 language model on the engine's interface: `forward(ids, batch, caches)` -> final-normed hidden states,
    `compute_logits`, `cache_specs`, `checkpoint_tensors`, `canonical_name`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 mxfp8_activations: bool | None = None, *, tp: ParallelGroup = SINGLE,
                 expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        """`mxfp8_activations`: round MXFP4 expert GEMM inputs through MXFP8; None reads
        `DELTASERVE_MXFP8_ACTIVATIONS`. `tp`, `expert_parallel`, `replicas`: as `KimiLinearForCausalLM`."""
        super().__init__()
        self.config, self.dtype, self.tp, self.replicas = config, dtype, tp, replicas
        mxfp8 = envs.mxfp8_activations() if mxfp8_activations is None else mxfp8_activations
        d = config.hidden_size
        self.vocab = VocabShard(config.vocab_size, tp)
        self.embed_tokens = nn.Parameter(torch.empty(self.vocab.rows, d, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i, dtype, mxfp8, tp, expert_parallel, eplb, replicas)
                                    for i in range(config.num_hidden_layers))
        self.norm = NormWeight(d, dtype)
        if config.attn_res_block_size is not None:
            self.output_attn_res = AttnResWeights(d, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(self.vocab.rows, d, dtype=dtype), requires_grad=False)

    @property
    def decoder_layers(self) -> Sequence[K3DecoderLayer]:
        """`layers` with its element type (`nn.ModuleList` is typed as holding any module)."""
        return cast("Sequence[K3DecoderLayer]", self.layers)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        """Every checkpoint tensor name (with the `language_model.` prefix) -> the tensor (or view) it loads into."""
        named: dict[str, torch.Tensor | Shard | None] = {
            "model.embed_tokens.weight": self.vocab.target(self.embed_tokens), "model.norm.weight": self.norm.weight,
        }
        if self.config.attn_res_block_size is not None:
            output_res = self.output_attn_res.checkpoint_tensors("output_attn_res")
            named.update({f"model.{k}": v for k, v in output_res.items()})
        if not self.config.tie_word_embeddings:
            named["lm_head.weight"] = self.vocab.target(self.lm_head)
        for i, layer in enumerate(self.decoder_layers):
            named.update({f"model.layers.{i}.{k}": v for k, v in layer.checkpoint_tensors().items()})
        return {TEXT_PREFIX + k: v for k, v in named.items()}

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """Accepted alternative names -> the `checkpoint_tensors` name; None for tensors to skip (vision part)."""
        if name.startswith(VISION_PREFIXES):
            return None
        return _DENSE_ALIAS.sub(r"\1mlp.\2", name)

    def cache_specs(self) -> list[KVCacheSpec | StateCacheSpec]:
        """As Kimi Linear, but the conv windows are fp32: K3's conv weights are fp32 and its conv runs in fp32
        (fp64 for an fp64 model, the oracle)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return layer_cache_specs(self.config, kv_dtype=dtype, conv_dtype="float64" if dtype == "float64" else "float32",
                                 tp_size=self.tp.size)

    def idle_experts(self) -> None:
        """`KimiLinearForCausalLM.idle_experts`: every MoE layer's token exchange, with no tokens of this replica's."""
        join_idle(self.replicas, [layer.mlp for layer in self.decoder_layers if layer.is_moe],
                  self.embed_tokens.new_empty(0, self.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]) -> torch.Tensor:
        """input_ids: [T] -> final-normed hidden states [T, d]. Reads and writes `caches` (one per layer)."""
        cfg = self.config
        if self.replicas is not None:  # the MoE layers' exchanges are sized by every replica's token count
            self.replicas.begin_step(input_ids.shape[0], input_ids.device)
        h = self.embed(input_ids)
        if batch.embed_rows is not None and batch.embed_values is not None:  # image placeholders: their features
            h = h.index_copy(0, batch.embed_rows, batch.embed_values.to(h.dtype))
        if cfg.attn_res_block_size is None:
            for layer, cache in zip(self.decoder_layers, caches, strict=True):
                h = layer(h, batch, cache)
        else:
            res = BlockAttnRes(h, cfg.attn_res_block_size, cfg.num_hidden_layers, cfg.rms_norm_eps)
            for layer, cache in zip(self.decoder_layers, caches, strict=True):
                layer.forward_attn_res(res, batch, cache)
            h = res.mix(self.output_attn_res)
        return rms_norm(h, self.norm.weight, cfg.rms_norm_eps)

    def prepack(self) -> int:
        """Pack the LM head for the CPU linear (`layers.linear.prepack_weights`); a tied head is the embedding table,
        read by row, and stays plain."""
        return 0 if self.config.tie_word_embeddings else pack_parameter(self, "lm_head")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [n] -> token embeddings [n, d] (on every rank: the vocabulary shards are reduced)."""
        return self.vocab.embed(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, d] -> fp32 logits [n, vocab] (on every rank: each computes its vocabulary share)."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return self.vocab.logits(hidden, head)
