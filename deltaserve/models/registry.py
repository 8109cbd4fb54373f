"""Top-level `architectures` name -> model class, imported lazily (only the architecture being loaded)."""

from __future__ import annotations

from collections.abc import Callable

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.models.protocol import ModelClass


def _kimi_linear() -> ModelClass:
    from deltaserve.models.kimi_linear import KimiLinearForCausalLM

    return KimiLinearForCausalLM


def _kimi_k3() -> ModelClass:
    from deltaserve.models.kimi_k3 import KimiK3ForConditionalGeneration

    return KimiK3ForConditionalGeneration


_MODELS: dict[str, Callable[[], ModelClass]] = {
    "KimiLinearForCausalLM": _kimi_linear,
    "KimiK3ForConditionalGeneration": _kimi_k3,
}


def model_class(config: ModelConfig) -> ModelClass:
    """The class that implements `config.architecture`."""
    try:
        load = _MODELS[config.architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {config.architecture!r} has no model class (supported: {sorted(_MODELS)})"
        ) from None
    return load()
