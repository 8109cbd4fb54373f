"""The `Model` protocol: both architectures satisfy it, as the registry builds them and as the loader returns them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.models.loader import load_model
from deltaserve.models.protocol import Model
from deltaserve.models.registry import model_class


@pytest.mark.parametrize("variant", ["base", "k3"])
def test_registry_classes_build_models(tiny_dir, variant):
    """Each architecture's class, built on the meta device, has every member the runner and loader call."""
    config = ModelConfig.from_pretrained(tiny_dir(variant))
    with torch.device("meta"):
        model = model_class(config)(config, dtype=torch.float32)
    assert isinstance(model, Model)
    assert len(model.cache_specs()) == config.num_hidden_layers


def test_load_model_returns_a_model(tiny_dir):
    assert isinstance(load_model(tiny_dir("base")), Model)


def test_a_plain_module_is_not_a_model():
    assert not isinstance(nn.Linear(2, 2), Model)

