"""Streaming reasoning / tool-call output parsers, one per chat format; `OUTPUT_PARSERS` maps format names to them."""

from __future__ import annotations

from deltaserve.parsers.kimi_k2 import KimiK2Parser
from deltaserve.parsers.kimi_k3 import KimiK3Parser
from deltaserve.parsers.types import OutputParser, ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

OUTPUT_PARSERS: dict[str, type[OutputParser]] = {"kimi_k2": KimiK2Parser, "kimi_k3": KimiK3Parser}
"""Format name (the upstream `--tool-call-parser` / `--reasoning-parser` names) -> parser class."""

__all__ = [
    "OUTPUT_PARSERS",
    "KimiK2Parser",
    "KimiK3Parser",
    "OutputParser",
    "ParsedDelta",
    "ParsedMessage",
    "ToolCall",
    "ToolCallDelta",
]
