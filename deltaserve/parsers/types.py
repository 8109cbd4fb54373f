"""What the reasoning / tool-call parsers return, and the interface every output parser implements.

A parser reads one output sequence's generated token ids (streamed in any chunking) and splits them into three
channels: reasoning text, answer content and tool calls. Markers that are special tokens are recognised on the ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One complete tool call, as the model emitted it (or as a client sent it back in the history)."""

    id: str
    """Call id (Kimi K2: the whole header, e.g. ``functions.get_weather:0``)."""
    name: str
    arguments: str
    """The arguments as JSON text (a client may send text that is not valid JSON; renderers keep it raw)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """Streaming progress of the tool call at ``index`` (0-based, in emission order)."""

    index: int
    id: str | None = None
    """Set once, in the first delta of the call."""
    name: str | None = None
    """Set once, in the first delta of the call."""
    arguments: str = ""
    """The next piece of the arguments JSON text (concatenating all pieces gives the call's arguments)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedDelta:
    """What one `push` (or `finish`) adds to each channel."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedMessage:
    """The whole output so far, split into channels."""

    reasoning: str | None
    """None when the output had no reasoning channel (thinking off)."""
    content: str
    tool_calls: tuple[ToolCall, ...] = ()


class OutputParser(ABC):
    """Streaming parser of one output sequence. Construct with ``(tokenizer, *, thinking, tools)``.

    ``thinking``: the prompt opened the reasoning channel, so output starts as reasoning. ``tools``: tools were
    offered, so tool-call sections are parsed into calls. Malformed output degrades to content; never raises.
    """

    @abstractmethod
    def push(self, token_ids: Sequence[int]) -> ParsedDelta:
        """Consume newly generated ids; return what can be emitted safely (a possible partial marker is held back)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of output: flush anything held back (an unterminated call's text degrades to content)."""

    @property
    @abstractmethod
    def message(self) -> ParsedMessage:
        """Everything parsed so far; the final message after `finish`."""
