"""ModelConfig for Kimi K3: top-level dispatch, the nested text_config and quantization_config, errors naming the
field with its `text_config.` path (model-spec §1)."""

from __future__ import annotations

import copy
import json

import pytest

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.models.quantize import compressed_tensors_config
from deltaserve.models.tiny import TinySpec
from deltaserve.models.tiny_k3 import tiny_k3_config_dict

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def k3_raw(**text_changes) -> dict:
    cfg = copy.deepcopy(tiny_k3_config_dict(TinySpec(arch="kimi_k3", q_lora_rank=48, shared_experts=2), IDS))
    cfg["text_config"].update(text_changes)
    return cfg


def test_k3_dispatches_on_the_top_level_architecture(tmp_path):
    """The nested text_config says model_type kimi_linear (and even KimiLinearForCausalLM): the top level wins, and
    every K3 field is read from text_config."""
    raw = k3_raw()
    assert raw["text_config"]["model_type"] == "kimi_linear"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.architecture == "KimiK3ForConditionalGeneration"
    assert (cfg.kda.gate_lower_bound, cfg.kda.use_full_rank_gate, cfg.mla.use_output_gate) == (-5.0, True, True)
    assert (cfg.mla.q_lora_rank, cfg.moe.num_shared_experts, cfg.moe.latent_size, cfg.moe.latent_use_norm) == (
        48, 2, 128, True)
    assert (cfg.activation.kind, cfg.activation.situ_beta, cfg.activation.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert cfg.attn_res_block_size == 3 and cfg.mla_layer_ids == (3, 7)
    assert cfg.quantization is not None and cfg.quantization.layout == "compressed-tensors"
    assert cfg.eos_token_ids == (2,)


def test_k3_optional_parts():
    """No attn_res_block_size: plain residuals; no quantization_config: dense experts; null betas: 1.0 and none;
    a gpt-oss quantization_config (quant_method mxfp4) selects the stacked layout."""
    raw = k3_raw(activation_situ_beta=None, activation_situ_linear_beta=None)
    for key in ("attn_res_block_size", "quantization_config"):
        raw["text_config"].pop(key)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.attn_res_block_size is None and cfg.quantization is None
    assert (cfg.activation.situ_beta, cfg.activation.situ_linear_beta) == (1.0, None)
    oss = ModelConfig.from_dict(k3_raw(quantization_config={"quant_method": "mxfp4"}))
    assert oss.quantization is not None and oss.quantization.layout == "gpt-oss"


def unknown_format() -> dict:
    q = compressed_tensors_config()
    q["format"] = q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    return q


def group_size_16() -> dict:
    q = compressed_tensors_config()
    q["config_groups"]["group_0"]["weights"]["group_size"] = 16
    return q


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"quantization_config": unknown_format()}, r"text_config\.quantization_config\.format='nvfp4"),
        ({"quantization_config": {"quant_method": "gptq"}}, r"text_config\.quantization_config\.quant_method"),
        ({"quantization_config": group_size_16()}, r"config_groups\.group_0\.weights\.group_size"),
        ({"hidden_act": "silu"}, r"text_config\.hidden_act"),
        ({"routed_expert_hidden_size": None}, r"text_config\.routed_expert_hidden_size"),
        ({"attn_res_block_size": 0}, r"text_config\.attn_res_block_size"),
        ({"hidden_size": None}, r"text_config\.hidden_size"),
        ({"num_expert_group": 3}, r"text_config\.num_expert_group"),
        ({"activation_situ_beta": -1.0}, r"text_config\.activation_situ_beta"),
    ],
    ids=["unknown-format", "unknown-method", "group-size", "act", "latent", "block-size", "null-field", "groups",
         "beta"],
)
def test_k3_bad_values_name_the_field(changes, needle):
    """Unsupported K3 values raise ConfigError naming the field under text_config."""
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(k3_raw(**changes))


def test_k3_top_level_errors():
    """A K3 architecture needs text_config and the matching top-level model_type; a lower bound must be negative;
    Kimi Linear refuses a quantization_config."""
    raw = k3_raw()
    del raw["text_config"]
    with pytest.raises(ConfigError, match="text_config is missing"):
        ModelConfig.from_dict(raw)
    raw = k3_raw()
    raw["model_type"] = "kimi_linear"
    with pytest.raises(ConfigError, match="model_type='kimi_linear' does not match"):
        ModelConfig.from_dict(raw)
    raw = k3_raw()
    raw["text_config"]["linear_attn_config"]["gate_lower_bound"] = 5.0
    with pytest.raises(ConfigError, match=r"text_config\.linear_attn_config\.gate_lower_bound"):
        ModelConfig.from_dict(raw)
    flat = {**k3_raw()["text_config"], "hidden_act": "silu"}
    with pytest.raises(ConfigError, match="quantization_config is not supported for KimiLinearForCausalLM"):
        ModelConfig.from_dict(flat)
