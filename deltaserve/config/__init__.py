"""Frozen configuration dataclasses: the model (from a checkpoint's config.json) and the engine's arguments."""

from deltaserve.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, parse_memory
from deltaserve.config.fields import ConfigError
from deltaserve.config.kv_transfer import KVTransferConfig, RemotePrefill
from deltaserve.config.media import MediaConfig
from deltaserve.config.model import ActivationConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig
from deltaserve.config.parallel_check import check_parallel
from deltaserve.config.quantization import QuantizationConfig
from deltaserve.config.server import ServerConfig
from deltaserve.config.speculative import SpeculativeConfig
from deltaserve.config.vision import VisionConfig

__all__ = [
    "check_parallel",
    "ActivationConfig",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "KDAConfig",
    "KVTransferConfig",
    "RemotePrefill",
    "MediaConfig",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "QuantizationConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "VisionConfig",
    "parse_memory",
]
