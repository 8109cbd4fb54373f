"""The Kimi K2 / Kimi Linear chat format (model-spec §12.1), rendered by a Python program instead of Jinja.

Matched sources (reference corpus):
- Kimi-K2-Instruct(-0905) template as reproduced, byte-parity tested, by PrimeIntellect-ai/renderers
  `renderers/kimi_k2.py`: tools declared first as compact JSON (`tojson(separators=(',', ':'))`), the default system
  prompt when the conversation does not start with one, followed by a literal newline, `## Return of {id}\\n` tool
  results under `<|im_system|>{name or "tool"}`, tool-call ids emitted verbatim.
- Kimi-Linear-48B-A3B-Instruct `tokenization_kimi.py` (copies in troy12x/quasar-kimi and a rev-919416f adaptation):
  `apply_chat_template` deep-sorts the tools (`deep_sort_dict`) first, so declaration keys are sorted at every depth.
- Kimi-K2-Thinking template (ggml-org/llama.cpp `models/templates/moonshotai-Kimi-K2-Thinking.jinja`) for thinking
  mode: assistant turns up to the last one without tool calls render `<think></think>` (reasoning dropped), later
  ones `<think>{reasoning}</think>`; the generation prompt then ends with `<think>` (the K2.5 form, model-spec §12.1).
With thinking off (the Kimi Linear default) assistant turns carry no think tags at all, as in K2-Instruct.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from deltaserve.chat.format import ChatFormat, check_length, deep_sort, encode_text, pick_tools
from deltaserve.chat.grammar import (
    MAX_PARALLEL_CALLS,
    REASONING_TERMINAL,
    answer_rule,
    json_rule,
    lark_str,
    token_rule,
)
from deltaserve.chat.media import IMAGE_KIND, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, interleave, media_ids
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deltaserve.parsers.types import OutputParser

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
THINK, THINK_END = "<think>", "</think>"
# Rule name in the grammars -> special token.
_GRAMMAR_TOKENS = {
    "im_end": "<|im_end|>",
    "section_begin": "<|tool_calls_section_begin|>",
    "section_end": "<|tool_calls_section_end|>",
    "call_begin": "<|tool_call_begin|>",
    "argument_begin": "<|tool_call_argument_begin|>",
    "call_end": "<|tool_call_end|>",
}

Part = int | str  # a special-token id, or text encoded with special tokens disallowed


class KimiK2Format(ChatFormat):
    """`<|im_*|>` turns with `<|im_middle|>` headers; tool calls in a `<|tool_calls_section_*|>` block."""

    name = "kimi_k2"
    default_thinking = False  # Kimi-Linear-48B-Instruct is non-thinking; clients opt in with {"thinking": true}
    required_tokens = (
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        *_GRAMMAR_TOKENS.values(),
    )

    def _stop_tokens(self) -> Iterable[int]:
        yield self.special_ids["<|im_end|>"]
        if "[EOS]" in self.tokenizer.special_tokens:
            yield self.tokenizer.special_tokens["[EOS]"]

    @property
    def supports_thinking(self) -> bool:
        """The tokenizer has the `<think>` / `</think>` pair (K2-Thinking, K2.5; not Kimi-Linear-48B)."""
        table = self.tokenizer.special_tokens
        return THINK in table and THINK_END in table

    def _think_ids(self) -> tuple[int, int]:
        if not self.supports_thinking:
            raise ValueError(f"thinking requested, but the tokenizer has no {THINK!r} / {THINK_END!r} tokens")
        table = self.tokenizer.special_tokens
        return table[THINK], table[THINK_END]

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
        """See `ChatFormat.render`; `tool_choice`, `response_format` and `thinking_effort` do not change a K2
        prompt."""
        think = self._think_ids() if thinking else None
        self._check_tool_choice(tool_choice, tools)
        if continue_final_message:
            self._check_continuation(messages, thinking=thinking, add_generation_prompt=add_generation_prompt)
        ids = self.special_ids
        system, middle, end = ids["<|im_system|>"], ids["<|im_middle|>"], ids["<|im_end|>"]
        parts: list[Part] = []
        if tools:
            declared = deep_sort([t.to_openai() for t in tools])
            parts += [system, "tool_declare", middle, json.dumps(declared, ensure_ascii=False, separators=(",", ":"))]
            parts.append(end)
        if not messages or messages[0].role != "system":
            parts += [system, "system", middle, DEFAULT_SYSTEM_PROMPT, end, "\n"]
        last_plain = max((i for i, m in enumerate(messages) if m.role == "assistant" and not m.tool_calls), default=-1)
        for i, message in enumerate(messages):
            parts += self._message(message, think=think, historical=i <= last_plain)
        if continue_final_message:
            parts.pop()  # the last assistant message's <|im_end|>: the model continues its text
        if add_generation_prompt:
            parts += [ids["<|im_assistant|>"], "assistant", middle]
            if think is not None:
                parts.append(think[0])
        return self._encode(parts, max_tokens)

    def _message(self, message: ChatMessage, *, think: tuple[int, int] | None, historical: bool) -> list[Part]:
        ids = self.special_ids
        role_token = {"user": ids["<|im_user|>"], "assistant": ids["<|im_assistant|>"]}.get(
            message.role, ids["<|im_system|>"]
        )
        parts: list[Part] = [role_token, message.name or message.role, ids["<|im_middle|>"]]
        if message.role == "assistant":
            if think is not None:
                parts += [think[0], "" if historical else message.reasoning or "", think[1]]
            parts.append(message.content)
            if message.tool_calls:
                parts.append(ids["<|tool_calls_section_begin|>"])
                for k, call in enumerate(message.tool_calls):
                    call_id = call.id or f"functions.{call.name}:{k}"
                    parts += [ids["<|tool_call_begin|>"], call_id, ids["<|tool_call_argument_begin|>"]]
                    parts += [call.arguments, ids["<|tool_call_end|>"]]
                parts.append(ids["<|tool_calls_section_end|>"])
        elif message.role == "tool":
            parts.append(f"## Return of {message.tool_call_id or ''}\n")
            parts += self._content(message)
        else:
            parts += self._content(message)
        parts.append(ids["<|im_end|>"])
        return parts

    def _content(self, message: ChatMessage) -> list[Part]:
        """The message text with its images' media markers and placeholders in place."""
        if not message.images:
            return [message.content]
        media = media_ids(self.tokenizer.special_tokens)
        parts: list[Part] = []
        for piece in interleave(message.content, message.images):
            if isinstance(piece, str):
                parts.append(piece)
            else:
                parts += [media[MEDIA_BEGIN], IMAGE_KIND, media[MEDIA_CONTENT]]
                parts += [media[MEDIA_PAD]] * piece.num_tokens + [media[MEDIA_END]]
        return parts

    def _encode(self, parts: list[Part], max_tokens: int | None) -> list[int]:
        """Special ids as they are; each run of adjacent text joined, then encoded with specials disallowed;
        `max_tokens` as in `ChatFormat.render`."""
        out: list[int] = []
        text: list[str] = []
        for part in [*parts, -1]:
            if isinstance(part, str):
                text.append(part)
                continue
            if text:
                out += encode_text(self.tokenizer, "".join(text), used=len(out), max_tokens=max_tokens)
                text = []
            if part >= 0:
                out.append(part)
        return check_length(out, max_tokens)

    def _grammar_head(self, thinking: bool) -> tuple[str, list[str]]:
        """(start-rule prefix, shared rules): the reasoning block when thinking, and the special-token rules."""
        rules = [token_rule(rule, self.special_ids[token]) for rule, token in _GRAMMAR_TOKENS.items()]
        if not thinking:
            return "", rules
        rules += [REASONING_TERMINAL, token_rule("think_end", self._think_ids()[1])]
        return "REASONING think_end ", rules

    def tool_call_grammar(
        self, tools: Sequence[ToolSpec], *, name: str | None, parallel: bool, thinking: bool
    ) -> StructuredOutput:
        """See `ChatFormat.tool_call_grammar`. Call ids are `functions.{name}:{k}` with k = 0, 1, ... per turn."""
        chosen = pick_tools(tools, name)
        prefix, shared = self._grammar_head(thinking)
        n = MAX_PARALLEL_CALLS if parallel else 1
        calls = "call_0 more_1?" if n > 1 else "call_0"
        lines = ["%llguidance {}", f"start: {prefix}section_begin {calls} section_end im_end"]
        lines += [f"more_{k}: call_{k}{f' more_{k + 1}?' if k + 1 < n else ''}" for k in range(1, n)]
        for k in range(n):
            heads = [f"{lark_str(f'functions.{t.name}:{k}')} argument_begin args_{j}" for j, t in enumerate(chosen)]
            lines.append(f"call_{k}: call_begin ({' | '.join(heads)}) call_end")
        lines += [json_rule(f"args_{j}", t.parameters) for j, t in enumerate(chosen)]
        return StructuredOutput("lark", "\n".join([*lines, *shared]) + "\n")

    def constrain(self, structured: StructuredOutput, *, thinking: bool) -> StructuredOutput:
        """See `ChatFormat.constrain`: [reasoning `</think>`] answer `<|im_end|>`."""
        prefix, shared = self._grammar_head(thinking)
        lines = ["%llguidance {}", f"start: {prefix}answer im_end", answer_rule("answer", structured)]
        return StructuredOutput("lark", "\n".join([*lines, *shared]) + "\n")

    def make_parser(self, tokenizer: Tokenizer, *, thinking: bool, tools: bool) -> OutputParser:
        from deltaserve.parsers.kimi_k2 import KimiK2Parser  # lazy: the parsers need not exist to render

        return KimiK2Parser(tokenizer, thinking=thinking, tools=tools)
