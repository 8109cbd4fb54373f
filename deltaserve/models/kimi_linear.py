"""Kimi Linear (`KimiLinearForCausalLM`): KDA and MLA mixers by the 1-based layer lists, dense then MoE FFNs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelGroup, Shard
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts
from deltaserve.layers.forward_batch import ForwardBatch, LayerCache
from deltaserve.layers.kda import KDAttention
from deltaserve.layers.linear import NormWeight, pack_parameter
from deltaserve.layers.mla import MLAttention
from deltaserve.layers.moe import GatedMLP, MoE
from deltaserve.layers.vocab import VocabShard
from deltaserve.ops.norm import rms_norm

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
"""A checkpoint's vision part (`models/kimi_vision.py` loads it): skipped by the language model's loader."""
# transformers' save_pretrained writes the dense layer-0 MLP as block_sparse_moe.*; real checkpoints use mlp.*.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def layer_cache_specs(config: ModelConfig, *, kv_dtype: str, conv_dtype: str,
                      tp_size: int = 1) -> list[KVCacheSpec | StateCacheSpec]:
    """Per layer: an MLA latent row per token (`kv_dtype`; whole on every tensor-parallel rank) or a KDA slot
    (recurrent state in at least fp32, conv window in `conv_dtype`; a rank's `num_heads / tp_size` heads). Shared by
    every KDA/MLA hybrid."""
    specs: list[KVCacheSpec | StateCacheSpec] = []
    # The recurrent state is at least fp32: fp64 for an fp64 model (the oracle), fp32 for fp32 and bf16.
    recurrent_dtype = str(torch.promote_types(getattr(torch, kv_dtype), torch.float32)).removeprefix("torch.")
    for i, kind in enumerate(config.layer_kinds):
        if kind == "mla":
            specs.append(KVCacheSpec(layer_id=i, row_width=config.mla.cache_row_width, dtype=kv_dtype))
        else:
            h, dh, k = config.kda.num_heads // tp_size, config.kda.head_dim, config.kda.conv_kernel_size
            specs.append(
                StateCacheSpec(
                    layer_id=i, recurrent_shape=(h, dh, dh), recurrent_dtype=recurrent_dtype,
                    conv_shape=(3 * h * dh, k - 1), conv_dtype=conv_dtype,
                )
            )
    return specs


class DecoderLayer(nn.Module):
    """h += Mixer(RMSNorm(h)); h += FFN(RMSNorm(h))  (model-spec §2.1)."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        super().__init__()
        d, self.eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = NormWeight(d, dtype)
        self.post_attention_layernorm = NormWeight(d, dtype)
        if config.layer_kinds[layer_id] == "kda":
            self.self_attn: KDAttention | MLAttention = KDAttention(config.kda, d, self.eps, layer_id, dtype, tp=tp)
        else:
            self.self_attn = MLAttention(config.mla, d, dtype, tp=tp)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            self.mlp: MoE | GatedMLP = MoE(config.moe, d, dtype, tp=tp, expert_parallel=expert_parallel, eplb=eplb,
                                           replicas=replicas)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, dtype, tp=tp)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        named: dict[str, torch.Tensor | Shard | None] = {
            "input_layernorm.weight": self.input_layernorm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        }
        named.update({f"self_attn.{k}": v for k, v in self.self_attn.checkpoint_tensors().items()})
        ffn = "block_sparse_moe" if self.is_moe else "mlp"
        named.update({f"{ffn}.{k}": v for k, v in self.mlp.checkpoint_tensors().items()})
        return named

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        h = h + self.self_attn(rms_norm(h, self.input_layernorm.weight, self.eps), batch, cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm.weight, self.eps))


def join_idle(replicas: ReplicaExperts | None, moe_layers: Sequence[nn.Module], none: torch.Tensor) -> None:
    """A model's step with no tokens on a replica whose experts span replicas: announce 0 tokens, then join every
    MoE layer's exchange with the empty `none` ``[0, d]``."""
    if replicas is not None:
        replicas.begin_step(0, none.device)
    for mlp in moe_layers:
        mlp(none)


class KimiLinearForCausalLM(nn.Module):
    """The whole text model. `forward` runs one flattened step; `compute_logits` the LM head on chosen rows."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, *, tp: ParallelGroup = SINGLE,
                 expert_parallel: bool = False, eplb: EPLBSettings | None = None,
                 replicas: ReplicaExperts | None = None) -> None:
        """`tp`: this rank's share of the heads, widths and vocabulary (one rank: the whole model);
        `expert_parallel`: routed experts partitioned whole over the ranks instead of each one sharded;
        `replicas`: over the ranks of several data-parallel replicas (then every forward, and `idle_experts` when
        this replica has nothing to run, exchanges tokens with the others)."""
        super().__init__()
        self.config, self.dtype, self.tp, self.replicas = config, dtype, tp, replicas
        d = config.hidden_size
        self.vocab = VocabShard(config.vocab_size, tp)
        self.embed_tokens = nn.Parameter(torch.empty(self.vocab.rows, d, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, tp, expert_parallel, eplb, replicas)
                                    for i in range(config.num_hidden_layers))
        self.norm = NormWeight(d, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(self.vocab.rows, d, dtype=dtype), requires_grad=False)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` with its element type (`nn.ModuleList` is typed as holding any module)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard | None]:
        """Every checkpoint tensor name -> the tensor (or view) it loads into."""
        named: dict[str, torch.Tensor | Shard | None] = {
            "model.embed_tokens.weight": self.vocab.target(self.embed_tokens), "model.norm.weight": self.norm.weight,
        }
        if not self.config.tie_word_embeddings:
            named["lm_head.weight"] = self.vocab.target(self.lm_head)
        for i, layer in enumerate(self.decoder_layers):
            named.update({f"model.layers.{i}.{k}": v for k, v in layer.checkpoint_tensors().items()})
        return named

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """Map accepted alternative checkpoint names onto the names `checkpoint_tensors` uses; None for the vision
        part's tensors (skipped)."""
        if name.startswith(VISION_PREFIXES):
            return None
        return _DENSE_ALIAS.sub(r"\1mlp.\2", name)

    def cache_specs(self) -> list[KVCacheSpec | StateCacheSpec]:
        """One spec per layer: MLA layers keep latent rows per token, KDA layers a state slot per sequence."""
        dtype = str(self.dtype).removeprefix("torch.")
        return layer_cache_specs(self.config, kv_dtype=dtype, conv_dtype=dtype, tp_size=self.tp.size)

    def idle_experts(self) -> None:
        """Join every MoE layer's token exchange with no tokens of this replica's (experts over data-parallel
        replicas: the step of a replica with nothing to run while another runs one)."""
        join_idle(self.replicas, [layer.mlp for layer in self.decoder_layers if layer.is_moe],
                  self.embed_tokens.new_empty(0, self.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]) -> torch.Tensor:
        """input_ids: [T] -> final-normed hidden states [T, d]. Reads and writes `caches` (one per layer)."""
        if self.replicas is not None:  # the MoE layers' exchanges are sized by every replica's token count
            self.replicas.begin_step(input_ids.shape[0], input_ids.device)
        h = self.embed(input_ids)
        if batch.embed_rows is not None and batch.embed_values is not None:  # image placeholders: their features
            h = h.index_copy(0, batch.embed_rows, batch.embed_values.to(h.dtype))
        for layer, cache in zip(self.decoder_layers, caches, strict=True):
            h = layer(h, batch, cache)
        return rms_norm(h, self.norm.weight, self.config.rms_norm_eps)

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
