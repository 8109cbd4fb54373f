"""Streaming reasoning + tool-call parser for the Kimi K2 / Kimi Linear output format (model-spec §12.1).

Markers are special tokens, recognised on the ids; text only stands in for a marker the tokenizer lacks, for the
hallucinated `</thinking>` and for the singular `<|tool_call_section_…|>` spelling (serving-lessons §10).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

from deltaserve.parsers.base import MarkerParser
from deltaserve.parsers.holdback import marker_table
from deltaserve.text.tokenizer import Tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
# Other spellings seen in outputs -> the marker they stand for. Matched as text where they are not tokens.
ALIASES = {
    "</thinking>": THINK_CLOSE,
    "<|tool_call_section_begin|>": SECTION_BEGIN,
    "<|tool_call_section_end|>": SECTION_END,
}
MARKERS = (THINK_OPEN, THINK_CLOSE, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

# `functions.NAME:IDX` or `NAME:IDX`; the name is between the last `.` and the `:`.
_HEADER_RE = re.compile(r"(?:[^\s:]*\.)?(?P<name>[^\s.:]+):\d+")
MAX_HEADER_CHARS = 512  # a longer "header" is not one: the call degrades to content without waiting for its end
EMPTY_ARGUMENTS = "{}"


class _State(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    SECTION = enum.auto()  # inside the tool-call section, between calls
    HEADER = enum.auto()  # after <|tool_call_begin|>, reading `functions.NAME:IDX`
    ARGS = enum.auto()  # after <|tool_call_argument_begin|> of a well-formed header
    BAD_CALL = enum.auto()  # the rest of a call whose header is malformed


class KimiK2Parser(MarkerParser):
    """Splits Kimi K2 / Kimi Linear output into reasoning, content and tool calls, streaming.

    - Reasoning: with `thinking` the output starts as reasoning; it ends at `</think>`, a hallucinated
      `</thinking>` text, or implicitly at the tool section. `<think>` in content reopens reasoning.
    - Tool calls: `<|tool_calls_section_begin|>` (or a bare `<|tool_call_begin|>`, which opens the section
      implicitly) … `<|tool_calls_section_end|>`; each call `<|tool_call_begin|>functions.NAME:IDX
      <|tool_call_argument_begin|>{json}<|tool_call_end|>`. Id = the header (whitespace-stripped), name = between
      its last `.` and the `:`. The id and name go out once, at the argument marker; then argument diffs.
      Arguments are raw text with surrounding whitespace removed (trailing whitespace is held until more text
      comes); invalid JSON is passed through as is; empty arguments become `{}`. Text between calls is dropped;
      text after the section end is content.
    - Malformed calls degrade to content: a header that is not `[prefix.]NAME:IDX` (or longer than
      `MAX_HEADER_CHARS`) sends the call's text (header, then arguments) to content; so does a header that ends
      (call end, next call, section end, end of output) without an argument marker.
    - Truncated call (arguments started, then the output ends or the section ends without `<|tool_call_end|>`):
      kept as a tool call with the arguments received so far. Its id and name were already streamed, so turning it
      into content would contradict the deltas; the finish reason tells the client it was cut.
    - `tools=False`: the whole tool section is dropped from every channel (it still ends reasoning); text after
      the section end is content.
    - Other special tokens (`<|im_end|>`, `[EOS]`, …) are dropped wherever they appear; so are markers that mean
      nothing in the current state (e.g. `</think>` in content). Marker-like text inside arguments is data.
    """

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool) -> None:
        by_id, text_only = marker_table(tokenizer, [*MARKERS, *ALIASES])
        super().__init__(
            tokenizer,
            thinking=thinking,
            tools=tools,
            marker_ids={i: ALIASES.get(name, name) for i, name in by_id.items()},
        )
        text_only_set = set(text_only)

        def spellings(names: set[str], *, aliases: bool) -> dict[str, str]:
            found = {name: name for name in names if name in text_only_set}
            if aliases:
                found |= {alias: name for alias, name in ALIASES.items() if name in names and alias in text_only_set}
            return found

        # `<think>` opens reasoning only as a token: answer text about think tags stays content.
        self._text_markers = {
            _State.REASONING: spellings({THINK_CLOSE, SECTION_BEGIN, CALL_BEGIN}, aliases=True),
            _State.CONTENT: spellings({SECTION_BEGIN, CALL_BEGIN}, aliases=True),
            _State.SECTION: spellings({SECTION_END, CALL_BEGIN}, aliases=True),
            _State.HEADER: spellings({ARG_BEGIN, CALL_END, CALL_BEGIN, SECTION_END}, aliases=False),
            _State.ARGS: spellings({CALL_END, CALL_BEGIN, SECTION_END}, aliases=False),
            _State.BAD_CALL: spellings({CALL_END, CALL_BEGIN, SECTION_END}, aliases=False),
        }
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._header = ""
        self._call_index = -1
        self._args_started = False
        self._args_space = ""  # trailing whitespace of the arguments, held until more text comes

    def text_markers(self) -> Mapping[str, str]:
        return self._text_markers[self._state]

    def on_text(self, text: str) -> None:
        state = self._state
        if state is _State.REASONING:
            self.out.add_reasoning(text)
        elif state in (_State.CONTENT, _State.BAD_CALL):
            self.out.add_content(text)
        elif state is _State.HEADER:
            self._header += text
            if len(self._header) > MAX_HEADER_CHARS:
                self.out.add_content(self._header)
                self._state = _State.BAD_CALL
        elif state is _State.ARGS:
            self._add_arguments(text)
        # _State.SECTION: noise between calls is dropped

    def on_marker(self, name: str) -> None:
        state = self._state
        in_call = state in (_State.HEADER, _State.ARGS, _State.BAD_CALL)
        if name == THINK_OPEN and state is _State.CONTENT:
            self.out.open_reasoning()
            self._state = _State.REASONING
        elif name == THINK_CLOSE and state is _State.REASONING:
            self._state = _State.CONTENT
        elif name == SECTION_BEGIN and state in (_State.REASONING, _State.CONTENT):
            self._state = _State.SECTION
        elif name == CALL_BEGIN:
            if in_call:
                self._end_call()
            self._state = _State.SECTION
            if self.tools:
                self._header = ""
                self._state = _State.HEADER
        elif name == ARG_BEGIN and state is _State.HEADER:
            self._start_arguments()
        elif name == CALL_END and in_call:
            self._end_call()
            self._state = _State.SECTION
        elif name == SECTION_END and (in_call or state is _State.SECTION):
            if in_call:
                self._end_call()
            self._state = _State.CONTENT

    def on_finish(self) -> None:
        if self._state is _State.HEADER:  # cut off (max_tokens) inside a call header: tool markup, not content
            self._header = ""
            self._state = _State.SECTION
        if self._state in (_State.ARGS, _State.BAD_CALL):
            self._end_call()

    def _start_arguments(self) -> None:
        header = self._header.strip()
        match = _HEADER_RE.fullmatch(header)
        if match is None:
            self.out.add_content(self._header)
            self._state = _State.BAD_CALL
            return
        self._call_index = self.out.start_call(header, match["name"])
        self._args_started = False
        self._args_space = ""
        self._state = _State.ARGS

    def _add_arguments(self, text: str) -> None:
        if not self._args_started:
            text = text.lstrip()
            if not text:
                return
            self._args_started = True
        text = self._args_space + text
        body = text.rstrip()
        self._args_space = text[len(body) :]
        self.out.add_arguments(self._call_index, body)

    def _end_call(self) -> None:
        """Close the current call, terminated or not (the caller sets the next state)."""
        if self._state is _State.HEADER:  # never reached its argument marker
            self.out.add_content(self._header)
        elif self._state is _State.ARGS and not self._args_started:
            self.out.add_arguments(self._call_index, EMPTY_ARGUMENTS)
        self._header = ""
        self._args_space = ""
