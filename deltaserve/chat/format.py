"""`ChatFormat`: the interface of a model family's chat format (prompt rendering, tool-call and answer grammars)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer, TokenLimitExceeded

if TYPE_CHECKING:
    from deltaserve.parsers.types import OutputParser

TOOL_CHOICES: tuple[str, ...] = ("auto", "none", "required")


class ChatFormat(ABC):
    """How one model family turns a conversation into prompt ids and constrains what the model answers.

    Built once per checkpoint from its `Tokenizer` (`deltaserve.chat.get_chat_format`); the constructor raises
    ValueError naming a special token the format needs and the tokenizer lacks. Instances are immutable and
    thread-safe. Structural markers are emitted as special-token ids; text supplied by clients (message content,
    names, tool declarations) is encoded with special tokens disallowed, so a typed marker stays text.
    """

    name: ClassVar[str]
    """Registry name: "kimi_k2" or "kimi_k3"."""
    default_thinking: ClassVar[bool]
    """Whether a request that does not say (chat_template_kwargs {"thinking": ...}) renders in thinking mode."""
    required_tokens: ClassVar[tuple[str, ...]]
    """Special tokens the format cannot work without."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids(tokenizer, self.required_tokens)
        self.stop_token_ids: frozenset[int] = frozenset(self._stop_tokens())  # ids that end an assistant turn

    @abstractmethod
    def _stop_tokens(self) -> Iterable[int]: ...

    @abstractmethod
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
        """Token ids of the prompt for `messages`.

        Args:
            tools: functions offered to the model (declared at the top of the prompt).
            thinking: render in thinking mode (the generation prompt opens the reasoning channel).
            add_generation_prompt: end with the opening of the assistant's turn.
            tool_choice: None / "auto", "none", "required" or a function name; formats with an internal
                tool-choice message render it, others ignore it (the grammar enforces the choice).
            response_format: the answer constraint, for formats that announce it in the prompt (K3).
            thinking_effort: "low", "medium", "high" or "max" for formats that announce it in thinking mode (K3;
                None: the format's default); others ignore it.
            continue_final_message: leave the last message, an assistant one without tool calls, open so that the
                model continues its text (a prefill); needs add_generation_prompt False and thinking off, and no
                internal tool-choice / response-format message.
            max_tokens: a prompt of more ids raises `TokenLimitExceeded(max_tokens)` as soon as that is known,
                without tokenizing the rest (a server refuses a prompt past its context whatever its length).

        Raises:
            ValueError: thinking requested but unsupported by the tokenizer, a malformed message, or a
                continue_final_message the conversation does not allow.
            TokenLimitExceeded: (a ValueError) the prompt has more than `max_tokens` ids.
        """

    @staticmethod
    def _check_continuation(messages: Sequence[ChatMessage], *, thinking: bool, add_generation_prompt: bool) -> None:
        """ValueError unless a prefill (continue_final_message) is possible for these settings."""
        if add_generation_prompt:
            raise ValueError("continuing the last message (continue_final_message) and starting a new assistant turn "
                             "(add_generation_prompt) cannot both be set")
        if not messages or messages[-1].role != "assistant" or messages[-1].tool_calls:
            raise ValueError("continuing the last message (a prefill) needs a last assistant message without tool "
                             "calls")
        if thinking:
            raise ValueError("continuing an assistant message (a prefill) is not supported in thinking mode")

    @abstractmethod
    def tool_call_grammar(
        self, tools: Sequence[ToolSpec], *, name: str | None, parallel: bool, thinking: bool
    ) -> StructuredOutput:
        """A Lark grammar forcing one (parallel: one or more) well-formed call(s) to `tools`, then end of turn.

        `name` None admits any of the tools (tool_choice "required"); a name forces that tool. Arguments match
        the tool's JSON schema. With `thinking` the output starts inside the reasoning channel the prompt opened:
        reasoning text, the end-of-reasoning marker, then the calls. Raises ValueError for an unknown name.
        """

    @abstractmethod
    def constrain(self, structured: StructuredOutput, *, thinking: bool) -> StructuredOutput:
        """A grammar whose answer content matches `structured`, then end of turn (reasoning first with thinking)."""

    @abstractmethod
    def make_parser(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool) -> OutputParser:
        """A fresh streaming parser for one output sequence of this format."""

    def _check_tool_choice(self, tool_choice: str | None, tools: Sequence[ToolSpec]) -> None:
        if tool_choice is None or tool_choice in TOOL_CHOICES:
            return
        if not any(t.name == tool_choice for t in tools):
            raise ValueError(f"tool_choice names {tool_choice!r}, which is not among the offered tools")


def encode_text(tokenizer: Tokenizer, text: str, *, used: int, max_tokens: int | None) -> list[int]:
    """Ids of client `text` (special tokens disallowed) for a prompt that holds `used` ids so far and may hold at
    most `max_tokens`: TokenLimitExceeded(max_tokens) as soon as the text cannot fit (see `ChatFormat.render`)."""
    if max_tokens is None:
        return tokenizer.encode(text, allow_special=False)
    try:
        return tokenizer.encode(text, allow_special=False, max_tokens=max(max_tokens - used, 0))
    except TokenLimitExceeded:
        raise TokenLimitExceeded(max_tokens) from None


def check_length(ids: list[int], max_tokens: int | None) -> list[int]:
    """`ids`, or TokenLimitExceeded when they are more than `max_tokens` (the special ids a render adds)."""
    if max_tokens is not None and len(ids) > max_tokens:
        raise TokenLimitExceeded(max_tokens)
    return ids


def special_ids(tokenizer: Tokenizer, names: Iterable[str]) -> dict[str, int]:
    """Ids of the named special tokens; ValueError naming the first one the tokenizer lacks."""
    table = tokenizer.special_tokens
    out = {}
    for name in names:
        if name not in table:
            raise ValueError(f"the tokenizer has no special token {name!r}, which this chat format needs")
        out[name] = table[name]
    return out


def deep_sort(obj: Any) -> Any:
    """Dicts with keys sorted at every depth (Moonshot's `deep_sort_dict`; lists keep their order)."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def pick_tools(tools: Sequence[ToolSpec], name: str | None) -> list[ToolSpec]:
    """The tools a tool-call grammar admits: all of them, or only `name` (ValueError when not offered)."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    if name is None:
        return list(tools)
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise ValueError(f"tool {name!r} is not among the offered tools {[t.name for t in tools]}")
    return chosen[:1]
