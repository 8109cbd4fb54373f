"""The model config: `ModelConfig.from_pretrained` is where a checkpoint's config.json stops.

Every field is documented once, here (K3's expert quantisation in `quantization.py`; typed field access with errors
that name the field in `fields.py`). Layers receive the sub-config they need (`KDAConfig`, `MLAConfig`, `MoEConfig`),
never the raw dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.config.fields import ConfigError, ConfigFields
from deltaserve.config.quantization import QuantizationConfig, parse_quantization
from deltaserve.config.vision import VisionConfig, parse_vision

K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
# Top-level `architectures[0]` -> the top-level `model_type` it must come with. K3 nests its text model under
# `text_config`, whose own model_type is "kimi_linear": dispatch never looks inside (model-spec §1.1).
_MODEL_TYPES = {"KimiLinearForCausalLM": "kimi_linear", K3_ARCHITECTURE: "kimi_k3"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES)
SUPPORTED_MODEL_TYPES = tuple(_MODEL_TYPES.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class KDAConfig:
    """Kimi Delta Attention (linear attention) layer shape."""

    num_heads: int
    """H: KDA heads (`linear_attn_config.num_heads`)."""
    head_dim: int
    """Dh: per-head key and value width; also the rank of the low-rank gates."""
    conv_kernel_size: int
    """K: width of the depthwise causal short convolution on q, k and v."""
    gate_lower_bound: float | None = None
    """None: softplus decay gate (Kimi Linear). A negative number: bounded sigmoid gate (Kimi K3)."""
    use_full_rank_gate: bool = False
    """Output gate is one full-rank `g_proj` (K3) instead of `g_a_proj` / `g_b_proj`."""

    @property
    def proj_dim(self) -> int:
        """H * Dh: width of each of the q, k, v projections."""
        return self.num_heads * self.head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (no positional encoding) layer shape."""

    num_heads: int
    """Hm: attention heads."""
    q_lora_rank: int | None
    """None: one `q_proj`; else `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` with this inner width."""
    kv_lora_rank: int
    """R: width of the cached latent."""
    qk_nope_head_dim: int
    """Dn: per-head query/key part expanded from the latent."""
    qk_rope_head_dim: int
    """Dr: the shared key part (one vector per token for all heads); no rotary is applied."""
    v_head_dim: int
    """Dv: per-head value width."""
    use_output_gate: bool = False
    """Multiply the attention output by sigmoid(g_proj x) before o_proj (K3)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row_width(self) -> int:
        """Values cached per token: the latent and the shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """DeepSeek-V3-style routed + shared experts."""

    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """Experts selected per token (`num_experts_per_token`)."""
    intermediate_size: int
    """I: routed-expert width (`moe_intermediate_size`)."""
    num_shared_experts: int
    """Shared-expert width is I * this; 0 means no shared expert."""
    scoring_func: str
    """Router activation (`moe_router_activation_func`): sigmoid or softmax."""
    num_expert_group: int
    """Groups for group-limited routing; 1 disables it."""
    topk_group: int
    """Groups kept by group-limited routing."""
    renormalize: bool
    """Renormalise the selected weights to sum to one (`moe_renormalize`)."""
    routed_scaling_factor: float
    """Multiplies the routed weights."""
    latent_size: int | None = None
    """K3 LatentMoE (`routed_expert_hidden_size`): routed experts run in this width, between a down projection of
    the hidden state and an up projection back; None (Kimi Linear): experts on the full hidden width."""
    latent_use_norm: bool = False
    """RMSNorm on the routed sum before the up projection (`latent_moe_use_norm`, K3)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationConfig:
    """The gated activation of every MLP and expert (`hidden_act`)."""

    kind: str = "silu"
    """"silu": SiLU-GLU (Kimi Linear); "situ": SiTU (K3, model-spec §6)."""
    situ_beta: float = 1.0
    """SiTU beta_1 (`activation_situ_beta`; null reads as 1.0, as NeMo does)."""
    situ_linear_beta: float | None = None
    """SiTU beta_2 (`activation_situ_linear_beta`); None leaves the up projection unbounded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The text model of a Kimi Linear or Kimi K3 checkpoint, read from its config.json with Moonshot field names."""

    architecture: str
    """The top-level `architectures[0]`; selects the model class in `models.registry`."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[str, ...]
    """Per 0-based layer: "kda" or "mla" (from the 1-based `linear_attn_config` lists)."""
    first_k_dense_replace: int
    """Layers [0, this) use a dense SiLU-GLU MLP; the rest use MoE."""
    intermediate_size: int
    """Width of the dense MLP layers."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Config eos id(s); the tokenizer and generation_config may add more stop ids."""
    pad_token_id: int | None
    max_model_len: int
    """`model_max_length` (or `max_position_embeddings`)."""
    torch_dtype: str
    """The checkpoint's stored dtype name, e.g. "bfloat16"."""
    activation: ActivationConfig = ActivationConfig()
    attn_res_block_size: int | None = None
    """K3 Block Attention Residuals: decoder layers per block (`attn_res_block_size`); None: plain residuals."""
    quantization: QuantizationConfig | None = None
    """K3 MXFP4 routed experts; None: every weight is stored unquantised."""
    vision: VisionConfig | None = None
    """The vision tower and projector (top-level `vision_config`: K3's, or a Kimi Linear checkpoint's that has one);
    None: a text-only checkpoint."""

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "kda")

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "mla")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (or a config.json path) into a validated ModelConfig."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate a config.json dict (Moonshot names; transformers' aliases accepted).

        Dispatch is on the top-level `architectures` / `model_type`. Kimi K3 keeps its text model (and its
        `quantization_config`) under `text_config`, whose own `model_type` says kimi_linear; errors about K3 fields
        name them with the `text_config.` prefix.
        """
        architecture = _check_architecture(raw)
        is_k3 = architecture == K3_ARCHITECTURE
        text = _text_config(raw) if is_k3 else raw
        f = ConfigFields(text, prefix="text_config." if is_k3 else "")
        num_layers = f.as_int("num_hidden_layers")
        linear = f.as_dict("linear_attn_config")
        lf = ConfigFields(linear, prefix=f"{f.prefix}linear_attn_config.")
        layer_kinds = _layer_kinds(lf, num_layers, text.get("layer_types"))
        num_heads = f.as_int("num_attention_heads")
        kv_heads = text.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != num_heads:
            raise ConfigError(
                f"{f.prefix}num_key_value_heads={kv_heads} must equal num_attention_heads={num_heads} (MLA)"
            )
        if text.get("mla_use_nope", True) is not True:
            raise ConfigError(f"{f.prefix}mla_use_nope must be true: only NoPE MLA is supported")
        if text.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{f.prefix}moe_layer_freq={text['moe_layer_freq']} is not supported (supported: 1)")
        moe = _moe(f, is_k3)
        _check_moe(moe, f.prefix)
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        return cls(
            architecture=architecture,
            vocab_size=f.as_int("vocab_size"),
            hidden_size=f.as_int("hidden_size"),
            num_hidden_layers=num_layers,
            layer_kinds=layer_kinds,
            first_k_dense_replace=f.as_int("first_k_dense_replace", default=0, minimum=0),
            intermediate_size=f.as_int("intermediate_size"),
            rms_norm_eps=f.as_float("rms_norm_eps", default=1e-5),
            tie_word_embeddings=f.as_bool("tie_word_embeddings", default=False),
            kda=KDAConfig(
                num_heads=lf.as_int("num_heads"),
                head_dim=lf.as_int("head_dim"),
                conv_kernel_size=lf.as_int("short_conv_kernel_size", default=4),
                gate_lower_bound=_lower_bound(lf),
                use_full_rank_gate=bool(linear.get("use_full_rank_gate", False)),
            ),
            mla=MLAConfig(
                num_heads=num_heads,
                q_lora_rank=f.as_int("q_lora_rank", default=None),
                kv_lora_rank=f.as_int("kv_lora_rank"),
                qk_nope_head_dim=f.as_int("qk_nope_head_dim"),
                qk_rope_head_dim=f.as_int("qk_rope_head_dim"),
                v_head_dim=f.as_int("v_head_dim"),
                use_output_gate=f.as_bool("mla_use_output_gate", default=False),
            ),
            moe=moe,
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            max_model_len=f.as_int("model_max_length", "max_position_embeddings", default=1 << 20),
            torch_dtype=f.as_str("torch_dtype", "dtype", default=raw.get("torch_dtype", "bfloat16")),
            activation=_activation(f, is_k3),
            attn_res_block_size=f.as_int("attn_res_block_size", default=None) if is_k3 else None,
            quantization=parse_quantization(text, raw, f.prefix, is_k3),
            vision=parse_vision(raw, f.as_int("hidden_size")),
        )


def _check_architecture(raw: dict[str, Any]) -> str:
    """The top-level architecture, checked against the top-level model_type."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError(f"config field architectures is missing (supported: {list(SUPPORTED_ARCHITECTURES)})")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"config field architectures={archs} is not supported (supported: {list(SUPPORTED_ARCHITECTURES)})"
        )
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config field model_type={model_type!r} is not supported (supported: {list(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type != _MODEL_TYPES[archs[0]]:
        raise ConfigError(
            f"config field model_type={model_type!r} does not match architectures={archs} "
            f"(expected {_MODEL_TYPES[archs[0]]!r})"
        )
    return archs[0]


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config field text_config is missing or not an object ({K3_ARCHITECTURE} keeps its "
                          "language model there)")
    return text


def _moe(f: ConfigFields, is_k3: bool) -> MoEConfig:
    return MoEConfig(
        num_experts=f.as_int("num_experts", "num_local_experts"),
        top_k=f.as_int("num_experts_per_token", "num_experts_per_tok"),
        intermediate_size=f.as_int("moe_intermediate_size"),
        num_shared_experts=f.as_int("num_shared_experts", "n_shared_experts", default=0),
        scoring_func=f.as_str("moe_router_activation_func", default="sigmoid"),
        num_expert_group=f.as_int("num_expert_group", "n_group", default=1),
        topk_group=f.as_int("topk_group", default=1),
        renormalize=f.as_bool("moe_renormalize", "norm_topk_prob", default=True),
        routed_scaling_factor=f.as_float("routed_scaling_factor", default=1.0),
        latent_size=f.as_int("routed_expert_hidden_size") if is_k3 else None,
        latent_use_norm=f.as_bool("latent_moe_use_norm", default=True) if is_k3 else False,
    )


def _lower_bound(lf: ConfigFields) -> float | None:
    bound = lf.as_float("gate_lower_bound", default=None)
    if bound is not None and bound >= 0:
        raise ConfigError(f"config field {lf.prefix}gate_lower_bound={bound} must be negative")
    return bound


def _activation(f: ConfigFields, is_k3: bool) -> ActivationConfig:
    """SiLU-GLU for Kimi Linear, SiTU for K3 (model-spec §6); the KDA short conv uses SiLU either way (§3.1)."""
    expected = "situ" if is_k3 else "silu"
    hidden_act = f.as_str("hidden_act", default=expected)
    if hidden_act != expected:
        raise ConfigError(
            f"config field {f.prefix}hidden_act={hidden_act!r} is not supported for "
            f"{K3_ARCHITECTURE if is_k3 else 'KimiLinearForCausalLM'} (supported: {expected!r})"
        )
    if not is_k3:
        return ActivationConfig()
    beta = f.as_float("activation_situ_beta", default=None)
    linear_beta = f.as_float("activation_situ_linear_beta", default=None)
    for name, value in (("activation_situ_beta", beta), ("activation_situ_linear_beta", linear_beta)):
        if value is not None and value <= 0:
            raise ConfigError(f"config field {f.prefix}{name}={value} must be positive")
    return ActivationConfig(kind="situ", situ_beta=1.0 if beta is None else beta, situ_linear_beta=linear_beta)


def _layer_kinds(lf: ConfigFields, num_layers: int, layer_types: Any) -> tuple[str, ...]:
    """Turn the 1-based `kda_layers` / `full_attn_layers` lists into one kind per 0-based layer."""
    kinds: list[str | None] = [None] * num_layers
    for field, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
        numbers = lf.get_raw(field)
        if not isinstance(numbers, list):
            raise ConfigError(f"config field {lf.prefix}{field} must be a list of 1-based layer numbers")
        for n in numbers:
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers:
                raise ConfigError(
                    f"config field {lf.prefix}{field} holds {n!r}: layer numbers are 1-based, in 1..{num_layers}"
                )
            if kinds[n - 1] is not None:
                raise ConfigError(
                    f"config field {lf.prefix}{field}: layer {n} is listed twice (kda_layers and "
                    "full_attn_layers must be disjoint)"
                )
            kinds[n - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(
            f"config fields {lf.prefix}kda_layers / full_attn_layers do not cover layers {missing} "
            f"(together they must list 1..{num_layers})"
        )
    if layer_types is not None:
        expected = ["linear_attention" if k == "kda" else "full_attention" for k in kinds]
        if list(layer_types) != expected:
            raise ConfigError(f"config field layer_types={layer_types} disagrees with linear_attn_config lists")
    return tuple(k for k in kinds if k is not None)


def _check_moe(moe: MoEConfig, prefix: str = "") -> None:
    if moe.scoring_func not in ("sigmoid", "softmax"):
        raise ConfigError(
            f"config field {prefix}moe_router_activation_func={moe.scoring_func!r} is not supported "
            "(supported: 'sigmoid', 'softmax')"
        )
    if moe.num_experts % moe.num_expert_group:
        raise ConfigError(
            f"config field {prefix}num_expert_group={moe.num_expert_group} must divide num_experts={moe.num_experts}"
        )
    if moe.topk_group > moe.num_expert_group:
        raise ConfigError(f"config field {prefix}topk_group={moe.topk_group} exceeds num_expert_group")
    group_size = moe.num_experts // moe.num_expert_group
    if moe.num_expert_group > 1 and group_size < 2:
        raise ConfigError(f"config field {prefix}num_expert_group leaves fewer than 2 experts per group")
    if moe.top_k > moe.topk_group * group_size:
        raise ConfigError(
            f"config field {prefix}num_experts_per_token={moe.top_k} exceeds the experts in topk_group groups "
            f"({moe.topk_group} x {group_size})"
        )
