"""The Kimi K3 "XTML" chat format (model-spec §12.2): a render program producing segments, encoded one by one.

Follows NVIDIA-NeMo/Automodel `nemo_automodel/components/models/kimi_k3/encoding.py` (`build_chat_segments`) and
`tokenization.py` (`apply_chat_template`, which defaults `thinking_effort` to "max"): message order, segment
boundaries, attribute escaping, typed arguments, tool results re-sorted into call order, the internal system
messages. Images in user and tool messages render as the K2.5 media markers (`chat/media.py`). Not supported here:
system messages that carry their own `tools` (the "New Tools Available" declaration), which `ChatMessage` lacks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from deltaserve.chat import xtml
from deltaserve.chat.format import ChatFormat, check_length, deep_sort, encode_text
from deltaserve.chat.media import IMAGE_KIND, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, interleave, media_ids
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.chat.xtml_grammar import answer_grammar, tool_call_grammar
from deltaserve.parsers.types import ToolCall
from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deltaserve.parsers.types import OutputParser


class KimiK3Format(ChatFormat):
    """`<|open|>tag attrs<|sep|> … <|close|>tag<|sep|>` messages ending in `<|end_of_msg|>`; think / response / tools
    channels in assistant turns."""

    name = "kimi_k3"
    default_thinking = True
    required_tokens = (xtml.OPEN, xtml.CLOSE, xtml.SEP, xtml.END_OF_MSG)

    def __init__(self, tokenizer: Tokenizer, *, thinking_effort: str | None = "max") -> None:
        """`thinking_effort`: announced in thinking mode ("max" is the checkpoint tokenizer's default; None omits
        the message)."""
        if thinking_effort is not None and thinking_effort not in xtml.THINKING_EFFORTS:
            raise ValueError(f"thinking_effort must be one of {xtml.THINKING_EFFORTS} or None, got {thinking_effort!r}")
        super().__init__(tokenizer)
        self.thinking_effort = thinking_effort

    def _stop_tokens(self) -> Iterable[int]:
        yield self.special_ids[xtml.END_OF_MSG]
        if "[EOS]" in self.tokenizer.special_tokens:
            yield self.tokenizer.special_tokens["[EOS]"]

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        thinking: bool,
        add_generation_prompt: bool = True,
        tool_choice: str | None = None,
        response_format: StructuredOutput | None = None,
        thinking_effort: str | None = None,
        continue_final_message: bool = False,
        max_tokens: int | None = None,
    ) -> list[int]:
        """See `ChatFormat.render`. tool_choice "required" / "none" and a json_object / json_schema
        `response_format` add K3's internal system messages; a named tool_choice adds none; `thinking_effort`
        replaces the format's default one in thinking mode."""
        self._check_tool_choice(tool_choice, tools)
        doc = self.segments(
            messages,
            tools=tools,
            thinking=thinking,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
            thinking_effort=thinking_effort,
            continue_final_message=continue_final_message,
        )
        return self.encode(doc, max_tokens=max_tokens)

    def segments(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        thinking: bool,
        add_generation_prompt: bool = True,
        tool_choice: str | None = None,
        response_format: StructuredOutput | None = None,
        thinking_effort: str | None = None,
        continue_final_message: bool = False,
    ) -> xtml.Segments:
        """The XTML document `render` encodes (`str()` of it is the prompt text)."""
        if continue_final_message:
            self._check_continuation(messages, thinking=thinking, add_generation_prompt=add_generation_prompt)
            if tool_choice in xtml.TOOL_CHOICE_TEXTS or response_format is not None:
                raise ValueError("a prefill (continue_final_message) cannot carry K3's tool-choice or "
                                 "response-format message, which follow the conversation")
            *messages, final = messages
        doc = xtml.Segments()
        if tools:
            declared = xtml.compact_json(deep_sort([t.to_openai() for t in tools]))
            doc.message([("role", "system"), ("type", "tool-declare")], xtml.tool_declaration(declared))
        effort = self.thinking_effort if thinking_effort is None else thinking_effort
        if effort not in (None, *xtml.THINKING_EFFORTS):
            raise ValueError(f"thinking_effort must be one of {xtml.THINKING_EFFORTS}, got {effort!r}")
        if thinking and effort is not None:
            doc.internal("thinking-effort", xtml.thinking_effort_text(effort))
        self._conversation(doc, messages, thinking)
        if tool_choice in xtml.TOOL_CHOICE_TEXTS:
            doc.internal("tool-choice", xtml.TOOL_CHOICE_TEXTS[tool_choice])
        if response_format is not None and response_format.kind in ("json_object", "json_schema"):
            schema = None
            if response_format.kind == "json_schema":
                schema = xtml.compact_json(deep_sort(_loads_schema(response_format.spec)))
            doc.internal("response-format", xtml.response_format_text(response_format.kind, schema))
        if add_generation_prompt:
            doc.open("message", [("role", "assistant")])
            doc.open("think" if thinking else "response")
        if continue_final_message:  # left open: the model continues the response channel
            doc.open("message", _with_name([("role", "assistant")], final))
            doc.open("response")
            doc.text(final.content)
        return doc

    def _conversation(self, doc: xtml.Segments, messages: Sequence[ChatMessage], thinking: bool) -> None:
        """The messages, each closed; tool results named after the calls they answer."""
        calls: Sequence[ToolCall] = ()
        tool_index = 0
        for message, resolved in resolve_tool_results(messages):
            if message.role == "assistant":
                calls, tool_index = message.tool_calls, 0
                doc.open("message", _with_name([("role", "assistant")], message))
                self._assistant_body(doc, message, thinking)
                doc.close("message")
                doc.control(xtml.END_OF_MSG)
            elif message.role == "tool":
                tool_index += 1
                tool = resolved or message.name
                if tool is None and tool_index <= len(calls):
                    tool = calls[tool_index - 1].name
                if tool is None:
                    raise ValueError(
                        "a Kimi K3 tool message needs a resolvable tool name: set name, or a tool_call_id matching "
                        "a call of the preceding assistant message"
                    )
                _message(doc, [("role", "tool"), ("tool", tool), ("index", tool_index)], message)
            else:
                _message(doc, _with_name([("role", message.role)], message), message)

    @staticmethod
    def _assistant_body(doc: xtml.Segments, message: ChatMessage, thinking: bool) -> None:
        if thinking:  # the think channel is structural in thinking mode: present even when empty
            doc.open("think")
            if message.reasoning and message.reasoning.strip():
                doc.text(message.reasoning)
            doc.close("think")
        doc.open("response")
        doc.text(message.content)
        doc.close("response")
        if not message.tool_calls:
            return
        doc.open("tools")
        for index, call in enumerate(message.tool_calls, start=1):
            doc.open("call", [("tool", call.name), ("index", index)])
            arguments, raw = xtml.parse_arguments(call.arguments)
            if raw is not None:
                doc.open("json", [("type", "object")])
                doc.text(raw)
                doc.close("json")
            for key, value in arguments.items():
                doc.open("argument", [("key", key), ("type", xtml.xtml_type(value))])
                doc.text(xtml.xtml_value(value))
                doc.close("argument")
            doc.close("call")
        doc.close("tools")

    def encode(self, doc: xtml.Segments, *, max_tokens: int | None = None) -> list[int]:
        """Ids of `doc`: each special segment its id, each text segment encoded separately, specials disallowed;
        `max_tokens` as in `ChatFormat.render`."""
        ids: list[int] = []
        for text, special in doc.items:
            if special:
                ids.append(self.special_ids[text] if text in self.special_ids else media_ids(
                    self.tokenizer.special_tokens)[text])
            else:
                ids += encode_text(self.tokenizer, text, used=len(ids), max_tokens=max_tokens)
        return check_length(ids, max_tokens)

    def tool_call_grammar(
        self, tools: Sequence[ToolSpec], *, name: str | None, parallel: bool, thinking: bool
    ) -> StructuredOutput:
        """See `ChatFormat.tool_call_grammar`: [think channel] empty response, a tools block, end of message.

        Arguments follow the schema's `properties` order (required ones present, optional ones may be skipped);
        string values are raw text, other values JSON, each with its `type` attribute.
        """
        return tool_call_grammar(self.special_ids, tools, name=name, parallel=parallel, thinking=thinking)

    def constrain(self, structured: StructuredOutput, *, thinking: bool) -> StructuredOutput:
        """See `ChatFormat.constrain`: [think channel] response channel holding the answer, end of message."""
        return answer_grammar(self.special_ids, structured, thinking=thinking)

    def make_parser(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool) -> OutputParser:
        from deltaserve.parsers.kimi_k3 import KimiK3Parser  # lazy: the parsers need not exist to render

        return KimiK3Parser(tokenizer, thinking=thinking, tools=tools)


def _message(doc: xtml.Segments, attrs: list[tuple[str, Any]], message: ChatMessage) -> None:
    """A whole message; its images as media markers around their placeholder tokens, where they sit in the text."""
    if not message.images:
        doc.message(attrs, message.content)
        return
    doc.open("message", attrs)
    for piece in interleave(message.content, message.images):
        if isinstance(piece, str):
            doc.text(piece)
        else:
            doc.control(MEDIA_BEGIN)
            doc.text(IMAGE_KIND)
            doc.control(MEDIA_CONTENT)
            for _ in range(piece.num_tokens):
                doc.control(MEDIA_PAD)
            doc.control(MEDIA_END)
    doc.close("message")
    doc.control(xtml.END_OF_MSG)


def _with_name(attrs: list[tuple[str, str]], message: ChatMessage) -> list[tuple[str, str]]:
    return [*attrs, ("name", message.name)] if message.name else attrs


def _loads_schema(spec: str) -> object:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"response_format json_schema spec is not valid JSON: {e}") from e


def resolve_tool_results(messages: Sequence[ChatMessage]) -> list[tuple[ChatMessage, str | None]]:
    """Messages with each run of consecutive tool results sorted into the order of the calls they answer.

    A run is matched by `tool_call_id` against the calls of the latest assistant message (1-based position; a
    repeated call id keeps its first position). When every result in the run matches, the run is sorted by call
    position (stable) and each result is paired with its call's name, which the rendering then uses; otherwise the
    run keeps its order and no name (as NeMo's `normalize_xtml_tool_result_messages`).
    """
    out: list[tuple[ChatMessage, str | None]] = []
    positions: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role != "tool":
            if message.role == "assistant":
                positions = {}
                for position, call in enumerate(message.tool_calls, start=1):
                    positions.setdefault(call.id, (position, call.name))
            out.append((message, None))
            i += 1
            continue
        run: list[ChatMessage] = []
        while i < len(messages) and messages[i].role == "tool":
            run.append(messages[i])
            i += 1
        matches = [positions.get(m.tool_call_id) if m.tool_call_id is not None else None for m in run]
        if all(match is not None for match in matches):
            matched = [(match, m) for match, m in zip(matches, run, strict=True) if match is not None]
            matched.sort(key=lambda item: item[0][0])  # stable: repeated ids keep their order
            out += [(m, name) for (_, name), m in matched]
        else:
            out += [(m, None) for m in run]
    return out
