"""`VisionConfig` from a K3 config.json: Moonshot's MoonViT names, transformers' names, the text-only stub, and
errors that name the field."""

from __future__ import annotations

import copy

import pytest

from deltaserve.config import ModelConfig
from deltaserve.config.fields import ConfigError
from deltaserve.config.vision import parse_vision
from deltaserve.models.tiny_k3 import tiny_k3_config_dict
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.models.tiny_vision import TinyVisionSpec, tiny_vision_config_dict

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def _k3(vision: dict | None, **top) -> dict:
    raw = copy.deepcopy(tiny_k3_config_dict(TinySpec(arch="kimi_k3"), IDS))
    if vision is None:
        raw.pop("vision_config")
    else:
        raw["vision_config"] = vision
    raw.update(top)
    return raw


def test_moonshot_names():
    """K2.5 / K3's `vt_*` and `init_pos_emb_*` names, the projector fields, the placeholder id at the top level."""
    vision = tiny_vision_config_dict(TinyVisionSpec(), text_hidden=256)
    config = ModelConfig.from_dict(_k3(vision, media_placeholder_token_id=163605)).vision
    assert config is not None
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size) == \
        (64, 2, 4, 96)
    assert (config.pos_emb_height, config.pos_emb_width, config.pos_emb_time) == (8, 8, 4)
    assert config.merge_kernel_size == (2, 2) and config.merge_area == 4 and config.merged_hidden_size == 256
    assert (config.projector_hidden_size, config.text_hidden_size) == (64, 256)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.rope_theta == 10000.0 and config.head_dim == 16
    assert config.media_placeholder_token_id == 163605


def test_transformers_names():
    """transformers' `Kimi_K25VisionConfig` names and top-level projector fields give the same config."""
    hf = {"model_type": "kimi_k25_vision", "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8,
          "pos_emb_time": 4, "num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 64,
          "intermediate_size": 96, "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2],
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    ours = ModelConfig.from_dict(_k3(tiny_vision_config_dict(TinyVisionSpec(), 256))).vision
    theirs = ModelConfig.from_dict(_k3(hf, projection_hidden_size=64, projection_layer_norm_eps=1e-5)).vision
    assert theirs == ours


@pytest.mark.parametrize("vision", [None, {"model_type": "kimi_k3_vision"}])
def test_no_tower(vision):
    """No `vision_config`, or a stub without a tower size (tiny text-only K3 checkpoints), is a text-only model."""
    assert ModelConfig.from_dict(_k3(vision)).vision is None


def test_kimi_linear_has_no_vision(tiny_dir):
    assert ModelConfig.from_pretrained(tiny_dir("base")).vision is None


def test_kimi_linear_with_a_tower_and_patch_limits(tiny_dir):
    """A Kimi Linear checkpoint may carry a `vision_config` (the embedded default model does), with the image
    processor's patch limits; without limits, transformers' K2.5 defaults hold."""
    import json

    raw = json.loads((tiny_dir("base") / "config.json").read_text())
    vision = {**tiny_vision_config_dict(TinyVisionSpec(), raw["hidden_size"]), "max_patches": 256,
              "max_patches_per_side": 16}
    config = ModelConfig.from_dict({**raw, "vision_config": vision, "media_placeholder_token_id": 7}).vision
    assert config is not None and config.media_placeholder_token_id == 7
    assert (config.max_patches, config.max_patches_per_side) == (256, 16)
    k3 = ModelConfig.from_dict(_k3(tiny_vision_config_dict(TinyVisionSpec(), 256))).vision
    assert k3 is not None and (k3.max_patches, k3.max_patches_per_side) == (16384, 512)
    with pytest.raises(ConfigError, match=r"vision_config\.max_patches=0 must be an integer >= 1"):
        ModelConfig.from_dict({**raw, "vision_config": {**vision, "max_patches": 0}})


BAD = {
    "missing-layers": ({"vt_num_hidden_layers": None}, r"vision_config\.vt_num_hidden_layers .*is missing"),
    "heads-not-dividing": ({"vt_num_attention_heads": 5}, r"vision_config\.vt_num_attention_heads=5 must divide"),
    "head-dim-not-4k": ({"vt_num_attention_heads": 32}, r"vt_num_attention_heads=32 .*multiple of 4"),
    "pos-emb-type": ({"pos_emb_type": "learned"}, r"vision_config\.pos_emb_type='learned' is not supported"),
    "merge-type": ({"merge_type": "sd2"}, r"vision_config\.merge_type='sd2' is not supported"),
    "projector-type": ({"mm_projector_type": "mlp"}, r"vision_config\.mm_projector_type='mlp' is not supported"),
    "act": ({"hidden_act": "relu"}, r"vision_config\.hidden_act='relu' is not supported"),
    "projector-act": ({"projector_hidden_act": "silu"}, r"vision_config\.projector_hidden_act='silu'"),
    "merge-kernel": ({"merge_kernel_size": [2]}, r"vision_config\.merge_kernel_size=\[2\] must be two integers"),
    "mm-hidden": ({"mm_hidden_size": 32}, r"vision_config\.mm_hidden_size=32 must equal vt_hidden_size=64"),
    "text-hidden": ({"text_hidden_size": 100}, r"vision_config\.text_hidden_size=100 disagrees with text_config"),
    "patch": ({"patch_size": 0}, r"vision_config\.patch_size=0 must be an integer >= 1"),
    "eps": ({"projector_ln_eps": -1.0}, r"vision_config\.projector_ln_eps=-1\.0 must be positive"),
    "rope": ({"rope_parameters": {"rope_type": "default"}}, r"rope_parameters\.rope_type='default' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_errors_name_the_field(case):
    change, message = BAD[case]
    vision = tiny_vision_config_dict(TinyVisionSpec(), text_hidden=256)
    for key, value in change.items():
        if value is None:
            vision.pop(key)
        else:
            vision[key] = value
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_k3(vision))


def test_vision_config_must_be_an_object():
    with pytest.raises(ConfigError, match="vision_config must be an object"):
        parse_vision({"vision_config": [1]}, 256)
