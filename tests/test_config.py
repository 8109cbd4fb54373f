"""ModelConfig.from_pretrained: Moonshot field names, 1-based layer lists, errors that name the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from deltaserve.config import CacheConfig, ConfigError, ModelConfig
from deltaserve.models.tiny import TinySpec, tiny_config_dict

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def raw(**changes):
    cfg = copy.deepcopy(tiny_config_dict(TinySpec(), IDS))
    cfg.update(changes)
    return cfg


def test_layer_lists_are_one_based(tmp_path):
    """Layer i (0-based) is MLA iff i + 1 is in full_attn_layers; dense iff i < first_k_dense_replace."""
    (tmp_path / "config.json").write_text(json.dumps(raw()))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.mla_layer_ids == (3, 7)
    assert cfg.kda_layer_ids == (0, 1, 2, 4, 5, 6)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    assert cfg.eos_token_ids == (2,)


def test_transformers_aliases_accepted():
    """transformers' names (num_local_experts, n_group, norm_topk_prob, ...) are read as their Moonshot fields."""
    r = raw()
    for moon, hf in [("num_experts", "num_local_experts"), ("num_expert_group", "n_group"),
                     ("moe_renormalize", "norm_topk_prob"), ("num_experts_per_token", "num_experts_per_tok")]:
        r[hf] = r.pop(moon)
    cfg = ModelConfig.from_dict(r)
    assert (cfg.moe.num_experts, cfg.moe.num_expert_group, cfg.moe.top_k) == (8, 2, 2)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"architectures": ["LlamaForCausalLM"]}, "KimiLinearForCausalLM"),
        ({"hidden_size": None}, "hidden_size"),
        ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
        ({"num_expert_group": 3}, "num_expert_group"),
        ({"num_experts_per_token": 9}, "num_experts_per_token"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"layer_types": ["full_attention"] * 8}, "layer_types"),
    ],
    ids=["model_type", "architecture", "null-field", "router-act", "groups", "top-k", "moe-freq", "nope", "kv-heads",
         "layer-types"],
)
def test_bad_values_name_the_field(changes, needle):
    """Unsupported or inconsistent values raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw(**changes))


@pytest.mark.parametrize(
    "kda, full, needle",
    [([1, 2, 3, 5, 6, 7], [4], "cover layers \\[8\\]"), ([1, 2, 3, 4, 5, 6, 7], [4, 8], "listed twice"),
     ([0, 1, 2, 4, 5, 6], [3, 7], "1-based")],
    ids=["uncovered", "overlap", "zero-based"],
)
def test_layer_list_errors(kda, full, needle):
    """The two 1-based lists must be disjoint and cover 1..num_hidden_layers."""
    r = raw()
    r["linear_attn_config"].update(kda_layers=kda, full_attn_layers=full)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(r)


def test_missing_field_is_named():
    """A required field that is absent is named in the error."""
    r = raw()
    del r["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank is missing"):
        ModelConfig.from_dict(r)
    del r["linear_attn_config"]["head_dim"]
    with pytest.raises(ConfigError, match="linear_attn_config.head_dim"):
        ModelConfig.from_dict(r)


@pytest.mark.parametrize("device", ["cuda0", "cuda:x", "mps"])
def test_engine_device_is_validated(device):
    from deltaserve.config import EngineConfig

    assert EngineConfig(model="m", device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device="):
        EngineConfig(model="m", device=device)


@pytest.mark.parametrize("changes, needle", [
    ({"watchdog_timeout_s": -1.0}, "watchdog_timeout_s"), ({"watchdog_timeout_s": float("nan")}, "watchdog_timeout_s"),
])
def test_scheduler_settings_are_validated(changes, needle):
    """A watchdog that cannot fire sensibly (negative: every step; NaN: never) is refused."""
    from deltaserve.config import SchedulerConfig

    with pytest.raises(ValueError, match=needle):
        SchedulerConfig(**changes)


@pytest.mark.parametrize("changes, needle", [
    ({"cache_memory": "2XB"}, "cache_memory='2XB'"), ({"cache_memory": "0"}, "cache_memory='0'"),
    ({"checkpoint_memory": "lots"}, "checkpoint_memory='lots'"),
])
def test_cache_memory_syntax_is_checked_in_the_config(changes, needle):
    """Memory sizes are parsed when the config is made, not later in the engine process."""
    from deltaserve.config import CacheConfig

    with pytest.raises(ValueError, match=needle):
        CacheConfig(**changes)


@pytest.mark.parametrize("make, needle", [
    (lambda c: c.EngineConfig(model="m", seed="x"), "seed must be int, got 'x'"),
    (lambda c: c.EngineConfig(model="m", max_model_len=2.5), "max_model_len must be int or None"),
    (lambda c: c.EngineConfig(model="m", num_threads=True), "num_threads must be int or None, got True"),
    (lambda c: c.EngineConfig(model="m", cache={}), "cache must be CacheConfig"),
    (lambda c: c.CacheConfig(block_size="16"), "block_size must be int, got '16'"),
    (lambda c: c.CacheConfig(enable_prefix_caching=1), "enable_prefix_caching must be bool"),
    (lambda c: c.SchedulerConfig(policy=None), "policy must be str"),
])
def test_engine_arguments_of_the_wrong_type_name_the_field(make, needle):
    """LLM(seed="x") or LLM(block_size="16") failed later with a torch or comparison error; now the config names the
    field. An int is a float, and memory sizes may be numbers."""
    import deltaserve.config as config

    with pytest.raises(ValueError, match=re.escape(needle)):
        make(config)


def test_engine_arguments_of_a_compatible_type_are_normalised():
    """numpy integers and floats (a common source of sizes) become int / float, a Path model a str; an int is a
    float and memory sizes may be numbers."""
    import numpy as np

    from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig

    cache = CacheConfig(block_size=np.int64(16), cache_memory=2**30, checkpoint_memory=np.float64(0.5))
    assert (type(cache.block_size), cache.cache_memory, type(cache.checkpoint_memory)) == (int, 2**30, float)
    assert SchedulerConfig(watchdog_timeout_s=5).watchdog_timeout_s == 5.0
    engine = EngineConfig(model=Path("/ckpt"), seed=np.uint64(7), max_model_len=None)
    assert (engine.model, engine.seed, type(engine.seed)) == ("/ckpt", 7, int)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_checkpoint_floats_are_refused(value):
    """config.json may hold NaN / Infinity (Python's json reads them); a NaN routed_scaling_factor would make every
    MoE output NaN."""
    with pytest.raises(ConfigError, match="routed_scaling_factor=.* must be a finite number"):
        ModelConfig.from_dict(raw(routed_scaling_factor=value))


def test_cache_memory_default_comes_from_the_environment(monkeypatch):
    """DELTASERVE_CACHE_MEMORY sets the default of CacheConfig.cache_memory and of --cache-memory; unset, 2GiB."""
    from deltaserve.entrypoints.cli import build_parser

    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY", "123MiB")
    assert CacheConfig().cache_memory == "123MiB"
    assert build_parser().parse_args(["serve"]).cache_memory == "123MiB"
    assert CacheConfig(cache_memory="1GiB").cache_memory == "1GiB"  # a given value wins
    monkeypatch.delenv("DELTASERVE_CACHE_MEMORY")
    assert CacheConfig().cache_memory == "2GiB"
    assert build_parser().parse_args(["generate", "--prompt", "x"]).cache_memory == "2GiB"
