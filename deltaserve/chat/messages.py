"""What a chat request carries into prompt rendering: the messages of the conversation and the offered tools."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from deltaserve.chat.media import ImageSlot, check_slots
from deltaserve.parsers.types import ToolCall

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


def _empty_object_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    """One message of a conversation, as a chat format renders it. Invalid values raise ValueError naming the field."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    name: str | None = None
    """Optional participant name (K2: replaces the role name in the header; K3: a `name` attribute)."""
    reasoning: str | None = None
    """Assistant history: the reasoning text of that turn (rendered only where the format keeps it)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant history: the calls the assistant made, in emission order."""
    tool_call_id: str | None = None
    """role == "tool": the id of the call this message is the result of."""
    images: tuple[ImageSlot, ...] = ()
    """User and tool messages: images placed in the content (rendered as media markers around placeholders)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"message content must be a string, got {type(self.content).__name__}")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if any(not isinstance(c, ToolCall) for c in self.tool_calls):
            raise ValueError("message tool_calls must be ToolCall values")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r}")
        object.__setattr__(self, "images", tuple(self.images))
        if self.images and self.role not in ("user", "tool"):
            raise ValueError(f"only user and tool messages carry images, not {self.role!r}")
        check_slots(self.content, self.images)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A function the model may call: its name, description and the JSON schema (an object) of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=_empty_object_schema)
    """JSON schema of the arguments object."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tool name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.parameters, Mapping):
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema object")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI-style declaration `{"type": "function", "function": {...}}` (no description key when empty)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """Inverse of `to_openai`; also accepts the bare function object."""
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or "name" not in function:
            raise ValueError(f"tool declaration needs a function name, got {dict(tool)!r}")
        parameters = function.get("parameters") or _empty_object_schema()
        return cls(name=function["name"], description=function.get("description") or "", parameters=parameters)
