"""Kimi K3 XTML building blocks: the segment list the renderer produces, and the fixed texts of its system messages.

Matched source: NVIDIA-NeMo/Automodel `nemo_automodel/components/models/kimi_k3/encoding.py` (commit 00ef9ca2, a
copy of the checkpoint's `encoding_k3.py`) and `tokenization.py` (segment-wise encoding). Texts below are
transcribed from it; the code is our own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
THINKING_EFFORTS: tuple[str, ...] = ("low", "medium", "high", "max")

Segment = tuple[str, bool]  # (text, is a structural special token)


def escape_attr(value: Any) -> str:
    """Attribute value text: `&` -> `&amp;`, `"` -> `&quot;` (nothing else is escaped)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class Segments:
    """An XTML document as segments. Every segment is BPE-encoded on its own, so token boundaries always fall at
    segment boundaries; empty text adds no segment."""

    def __init__(self) -> None:
        self.items: list[Segment] = []

    def control(self, token: str) -> None:
        self.items.append((token, True))

    def text(self, text: str) -> None:
        if text:
            self.items.append((text, False))

    def open(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        """`<|open|>tag key="value"...<|sep|>`: key, `="`, the escaped value and `"` are separate segments."""
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def message(self, attrs: Iterable[tuple[str, Any]], body: str) -> None:
        """A whole message whose body is one text: open, body, close, `<|end_of_msg|>`."""
        self.open("message", attrs)
        self.text(body)
        self.close("message")
        self.control(END_OF_MSG)

    def internal(self, kind: str, body: str) -> None:
        """An internal system message (`type="thinking-effort"` etc.); its body is stripped."""
        self.message([("role", "system"), ("type", kind)], body.strip())

    def __str__(self) -> str:
        return "".join(text for text, _ in self.items)


def tool_declaration(tools_json: str) -> str:
    return f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools_json}\n```"


def thinking_effort_text(effort: str) -> str:
    return (
        "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
        "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={effort}`."
    )


TOOL_CHOICE_TEXTS = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."


def response_format_text(kind: str, schema_json: str | None) -> str:
    """The response-format message for kind "json_object" or "json_schema" (with the compact, sorted schema)."""
    text = f"The system is invoked with `response_format={kind}`.\n{_RAW_JSON}"
    if kind == "json_schema":
        text += f"\nThe JSON data must match the following schema:\n```json\n{schema_json}\n```"
    return text


def xtml_type(value: Any) -> str:
    """The `type` attribute of an argument holding `value` (from `json.loads`)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def xtml_value(value: Any) -> str:
    """Argument body: a string raw, anything else as JSON (Python's default separators, as the reference)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_arguments(arguments: str) -> tuple[dict[str, Any], str | None]:
    """(arguments object, None), or ({}, the raw text) when it is not JSON. Blank text is an empty object.

    Raises ValueError when the text is JSON but not an object (the reference refuses it too).
    """
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"Kimi K3 tool call arguments must be a JSON object, got {arguments!r}")
    return parsed, None
