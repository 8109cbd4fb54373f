"""Frozen configuration dataclasses: the model (from a checkpoint's config.json) and the engine's arguments."""

from deltaserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig, parse_memory
from deltaserve.config.model import ConfigError, KDAConfig, MLAConfig, ModelConfig, MoEConfig
from deltaserve.config.server import ServerConfig

__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "KDAConfig",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "SchedulerConfig",
    "ServerConfig",
    "parse_memory",
]
