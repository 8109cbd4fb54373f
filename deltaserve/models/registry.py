"""Top-level `architectures` name -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from deltaserve.config import ConfigError, ModelConfig

_MODELS: dict[str, tuple[str, str]] = {
    "KimiLinearForCausalLM": ("deltaserve.models.kimi_linear", "KimiLinearForCausalLM"),
    "KimiK3ForConditionalGeneration": ("deltaserve.models.kimi_k3", "KimiK3ForConditionalGeneration"),
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class that implements `config.architecture`."""
    try:
        module_name, class_name = _MODELS[config.architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {config.architecture!r} has no model class (supported: {sorted(_MODELS)})"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
