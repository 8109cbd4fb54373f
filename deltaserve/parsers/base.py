"""The driver shared by the Kimi output parsers: ids -> events -> a format's state machine -> per-push deltas.

A format subclass sees special-token markers by name, text markers (found with hold-back) by name, and plain text;
it writes into a `MessageBuilder`, which turns what one push added into a `ParsedDelta`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deltaserve.parsers.holdback import Special, TokenEvents, scan_markers
from deltaserve.parsers.types import OutputParser, ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta
from deltaserve.text.tokenizer import Tokenizer


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class MessageBuilder:
    """Accumulates the three channels of one output and what the current push added to each."""

    def __init__(self, *, reasoning: bool) -> None:
        self._reasoning: list[str] | None = [] if reasoning else None
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._new_reasoning: list[str] = []
        self._new_content: list[str] = []
        self._new_args: dict[int, list[str]] = {}  # call index -> argument pieces added by this push
        self._new_calls: set[int] = set()  # calls started by this push

    def open_reasoning(self) -> None:
        """The output has a reasoning channel (possibly empty)."""
        if self._reasoning is None:
            self._reasoning = []

    def add_reasoning(self, text: str) -> None:
        if text:
            self.open_reasoning()
            assert self._reasoning is not None
            self._reasoning.append(text)
            self._new_reasoning.append(text)

    def add_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._new_content.append(text)

    def start_call(self, call_id: str, name: str) -> int:
        """Announce a tool call (its id and name go out in the next delta); returns its 0-based index."""
        self._calls.append(_Call(call_id, name))
        index = len(self._calls) - 1
        self._new_calls.add(index)
        self._new_args[index] = []
        return index

    def add_arguments(self, index: int, text: str) -> None:
        if text:
            self._calls[index].arguments.append(text)
            self._new_args.setdefault(index, []).append(text)

    def num_calls(self) -> int:
        return len(self._calls)

    def take_delta(self) -> ParsedDelta:
        """What was added since the last call, as one delta (tool-call pieces merged per call, in index order)."""
        calls = tuple(
            ToolCallDelta(
                index=i,
                id=self._calls[i].id if i in self._new_calls else None,
                name=self._calls[i].name if i in self._new_calls else None,
                arguments="".join(pieces),
            )
            for i, pieces in sorted(self._new_args.items())
            if pieces or i in self._new_calls
        )
        delta = ParsedDelta(
            reasoning="".join(self._new_reasoning), content="".join(self._new_content), tool_calls=calls
        )
        self._new_reasoning, self._new_content, self._new_args, self._new_calls = [], [], {}, set()
        return delta

    def message(self) -> ParsedMessage:
        for parts in (self._reasoning, self._content, *(c.arguments for c in self._calls)):
            if parts is not None and len(parts) > 1:  # join once, so repeated reads stay cheap
                parts[:] = ["".join(parts)]
        return ParsedMessage(
            reasoning=None if self._reasoning is None else "".join(self._reasoning),
            content="".join(self._content),
            tool_calls=tuple(ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments)) for c in self._calls),
        )


class MarkerParser(OutputParser):
    """Drives a format state machine over the events of one output sequence.

    Subclasses declare the marker tokens they recognise (`marker_ids`: id -> name; every other special token is
    dropped), the text markers live in the current state (`text_markers`), and handle `on_text`, `on_marker` and
    `on_finish`. Text reaches `on_text` only once no later output can turn it into (part of) a text marker, so the
    result does not depend on how the ids were chunked. `push` after `finish` raises RuntimeError (a caller bug).
    """

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool, marker_ids: Mapping[int, str]) -> None:
        self.thinking = thinking
        self.tools = tools
        self._marker_ids = dict(marker_ids)
        self._events = TokenEvents(tokenizer, set(tokenizer.all_special_ids) | self._marker_ids.keys())
        self._held = ""  # text that may be the start of a text marker
        self._finished = False
        self.out = MessageBuilder(reasoning=thinking)

    def push(self, token_ids: Sequence[int]) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("push() after finish()")
        for event in self._events.push(token_ids):
            if isinstance(event, Special):
                self._consume_text("", final=True)  # a text marker never spans a token
                name = self._marker_ids.get(event.token_id)
                if name is not None:
                    self.on_marker(name)
            else:
                self._consume_text(event, final=False)
        return self.out.take_delta()

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._finished = True
        for event in self._events.finish():
            assert isinstance(event, str)
            self._consume_text(event, final=False)
        self._consume_text("", final=True)
        self.on_finish()
        return self.out.take_delta()

    @property
    def message(self) -> ParsedMessage:
        return self.out.message()

    def _consume_text(self, text: str, *, final: bool) -> None:
        text = self._held + text
        self._held = ""
        while text:
            cut, name, end = scan_markers(text, self.text_markers(), final=final)
            if cut:
                self.on_text(text[:cut])
            if name is None:
                self._held = text[cut:]
                return
            self.on_marker(name)
            text = text[end:]

    @abstractmethod
    def text_markers(self) -> Mapping[str, str]:
        """Text spellings (-> marker name) recognised in the current state; usually empty."""

    @abstractmethod
    def on_text(self, text: str) -> None:
        """Plain text, in order; never part of a marker."""

    @abstractmethod
    def on_marker(self, name: str) -> None:
        """A marker (a recognised special token, or a text marker of the current state)."""

    @abstractmethod
    def on_finish(self) -> None:
        """End of output: resolve whatever is still open."""
