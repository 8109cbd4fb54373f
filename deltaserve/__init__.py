"""deltaserve: a serving engine for hybrid linear-attention MoE models (Kimi Linear / Kimi K3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaserve.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from deltaserve.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # torch is imported only when the engine is used
    if name == "LLM":
        from deltaserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
