"""Streaming reasoning + tool-call parser for the Kimi K3 XTML output format (model-spec §12.2).

A marker is `<|open|>` or `<|close|>` (special tokens), a tag written as text, then `<|sep|>`: the parser holds the
tag text from the opening token to `<|sep|>` and acts on the whole marker, so a partial marker never leaks.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from deltaserve.parsers.base import MarkerParser
from deltaserve.text.tokenizer import Tokenizer

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
MAX_TAG_CHARS = 1024  # text after <|open|> / <|close|> this long without <|sep|> is not a tag: it becomes text again
EMPTY_ARGUMENTS = "{}"

_TAG_NAME_RE = re.compile(r"\s*([^\s=\"]+)")
_ATTR_RE = re.compile(r'([\w-]+)="([^"]*)"')
_ENTITY_RE = re.compile(r"&(quot|amp);")
_ENTITIES = {"quot": '"', "amp": "&"}


class _Channel(enum.Enum):
    TOP = enum.auto()  # between channels: whitespace is dropped, other text is content
    THINK = enum.auto()
    RESPONSE = enum.auto()
    TOOLS = enum.auto()


_CHANNEL_TAGS = {"think": _Channel.THINK, "response": _Channel.RESPONSE, "tools": _Channel.TOOLS}


@dataclass(slots=True)
class _Element:
    """An open `argument` (key, type) or `json` child of a call."""

    tag: str
    key: str = ""
    type: str = "string"
    value: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Call:
    name: str
    arguments: dict[str, object] = field(default_factory=dict)
    json_text: str | None = None  # the first `json` child's raw text
    raw: list[str] = field(default_factory=list)  # every child's text, for degrading to content
    element: _Element | None = None


def _attrs(text: str) -> dict[str, str]:
    return {k: _ENTITY_RE.sub(lambda m: _ENTITIES[m[1]], v) for k, v in _ATTR_RE.findall(text)}


def _value(element: _Element) -> object:
    """A string argument is its raw text; any other type is JSON (its raw text when that does not parse)."""
    raw = "".join(element.value)
    if element.type == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _close_element(call: _Call) -> None:
    element, call.element = call.element, None
    if element is None:
        return
    if element.tag == "json":
        if call.json_text is None:
            call.json_text = "".join(element.value)
    else:
        call.arguments[element.key] = _value(element)


class KimiK3Parser(MarkerParser):
    """Splits Kimi K3 XTML output into reasoning, content and tool calls, streaming.

    - Channels: `think` -> reasoning, `response` -> content, `tools` -> tool calls. Output starts inside `think`
      (`thinking`) or `response`. Opening a channel closes the open one (and re-opening the open one is a no-op);
      `<|close|>message<|sep|>` closes everything. Closing a channel that is not open is ignored.
    - Text between channels is dropped when it is whitespace only (per run between markers), else it is content.
    - Tool calls: `<|open|>call tool="NAME" index="i"<|sep|>` with `argument key="K" type="T"` children (string
      values raw, other types JSON-decoded, raw when invalid) or a `json type="object"` child (its raw text, used
      only when the call has no argument children). Attribute values are unescaped (`&quot;`, `&amp;`). A call is
      emitted whole (id, name, arguments as one JSON object text) when `<|close|>call<|sep|>` arrives. Ids are
      `functions.NAME:{k}`, k = the call's 0-based position in this output (the K2 id convention). A `call`
      outside a `tools` channel opens one implicitly. Text in `tools` outside calls, and in a call between its
      children, is dropped.
    - Malformed and truncated calls: `<|close|>call<|sep|>` with a child still open accepts that child as is.
      A call ended any other way (next call, another channel, message close, end of output) is still a call when
      all its children were closed; with a child still open it is dropped and its children's text goes to content.
      A call without a `tool` attribute degrades to content the same way.
    - A marker not completed by `<|sep|>` before the next `<|open|>` / `<|close|>` or the end of output is dropped;
      after `MAX_TAG_CHARS` without `<|sep|>` its text is treated as ordinary text again.
    - `tools=False`: the `tools` channel is parsed but produces nothing (no calls, no content).
    - Other special tokens (`<|end_of_msg|>`, `[EOS]`, …) are dropped. Marker-like text (e.g. the characters
      `<|close|>argument<|sep|>` inside a string argument) is data: markers are special-token ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool) -> None:
        specials = tokenizer.special_tokens
        missing = [name for name in (OPEN, CLOSE, SEP) if name not in specials]
        if missing:
            raise ValueError(f"tokenizer has no K3 structural tokens {missing}; is this a Kimi K3 tokenizer?")
        marker_ids = {specials[OPEN]: OPEN, specials[CLOSE]: CLOSE, specials[SEP]: SEP}
        super().__init__(tokenizer, thinking=thinking, tools=tools, marker_ids=marker_ids)
        self._channel = _Channel.THINK if thinking else _Channel.RESPONSE
        self._pending: tuple[str, list[str]] | None = None  # (OPEN or CLOSE, tag text so far)
        self._pending_chars = 0
        self._call: _Call | None = None
        self._top_space = ""  # a whitespace-only run between channels, held until it turns out to be content
        self._top_visible = False  # the current run between channels has non-whitespace text

    def text_markers(self) -> Mapping[str, str]:
        return {}

    def on_text(self, text: str) -> None:
        if self._pending is not None:
            self._pending[1].append(text)
            self._pending_chars += len(text)
            if self._pending_chars <= MAX_TAG_CHARS:
                return
            text = "".join(self._pending[1])
            self._pending = None
        self._channel_text(text)

    def on_marker(self, name: str) -> None:
        self._top_space, self._top_visible = "", False  # a marker ends the run between channels
        if name == SEP:
            if self._pending is not None:
                kind, parts = self._pending
                self._pending = None
                self._on_tag(kind, "".join(parts))
            return
        self._pending = (name, [])  # an unfinished earlier marker is dropped
        self._pending_chars = 0

    def on_finish(self) -> None:
        self._pending = None
        if self._call is not None:
            self._end_call(explicit=False)

    def _channel_text(self, text: str) -> None:
        call = self._call
        if call is not None:
            if call.element is not None:
                call.element.value.append(text)
                call.raw.append(text)
        elif self._channel is _Channel.THINK:
            self.out.add_reasoning(text)
        elif self._channel is _Channel.RESPONSE:
            self.out.add_content(text)
        elif self._channel is _Channel.TOP:
            if self._top_visible:
                self.out.add_content(text)
                return
            text = self._top_space + text
            if text.isspace():
                self._top_space = text
            else:
                self._top_space, self._top_visible = "", True
                self.out.add_content(text)

    def _on_tag(self, kind: str, text: str) -> None:
        match = _TAG_NAME_RE.match(text)
        tag = match[1] if match else ""
        attrs = _attrs(text[match.end() :]) if match else {}
        if kind == OPEN:
            self._open(tag, attrs)
        else:
            self._close(tag)

    def _open(self, tag: str, attrs: dict[str, str]) -> None:
        if tag in _CHANNEL_TAGS:
            self._enter(_CHANNEL_TAGS[tag])
        elif tag == "call":
            self._enter(_Channel.TOOLS)
            if self._call is not None:
                self._end_call(explicit=False)
            self._call = _Call(name=attrs.get("tool", ""))
        elif tag in ("argument", "json") and self._call is not None:
            _close_element(self._call)
            self._call.element = _Element(tag, key=attrs.get("key", ""), type=attrs.get("type", "string"))
        # `message` and unknown tags: the marker is dropped

    def _close(self, tag: str) -> None:
        if (tag in _CHANNEL_TAGS and _CHANNEL_TAGS[tag] is self._channel) or tag == "message":
            self._enter(_Channel.TOP)
        elif tag == "call" and self._call is not None:
            self._end_call(explicit=True)
        elif tag in ("argument", "json") and self._call is not None and self._call.element is not None:
            if self._call.element.tag == tag:
                _close_element(self._call)

    def _enter(self, channel: _Channel) -> None:
        if channel is self._channel:
            return
        if self._call is not None:
            self._end_call(explicit=False)
        self._channel = channel
        if channel is _Channel.THINK:
            self.out.open_reasoning()

    def _end_call(self, *, explicit: bool) -> None:
        call, self._call = self._call, None
        if call is None or not self.tools:
            return
        if explicit:
            _close_element(call)
        if call.element is not None or not call.name:  # truncated, or no tool name: degrade to content
            self.out.add_content("".join(call.raw))
            return
        if call.arguments or call.json_text is None:
            arguments = json.dumps(call.arguments, ensure_ascii=False)
        else:
            arguments = call.json_text.strip() or EMPTY_ARGUMENTS
        index = self.out.start_call(f"functions.{call.name}:{self.out.num_calls()}", call.name)
        self.out.add_arguments(index, arguments)
