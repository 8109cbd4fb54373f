"""Kimi K2 / Kimi Linear rendering: headers, default system prompt, tools, tool calls and results, thinking."""

from __future__ import annotations

import json

import pytest

from deltaserve.chat import ChatMessage, KimiK2Format, ToolSpec
from deltaserve.chat.kimi_k2 import DEFAULT_SYSTEM_PROMPT
from deltaserve.parsers.types import ToolCall

DEFAULT_SYSTEM = f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
GEN = "<|im_assistant|>assistant<|im_middle|>"
WEATHER = ToolSpec(
    name="get_weather",
    description="Get the weather",
    parameters={"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "é"}}},
)


def text(fmt: KimiK2Format, messages: list[ChatMessage], **kw) -> str:
    kw.setdefault("thinking", False)
    return fmt.tokenizer.decode(fmt.render(messages, **kw))


def test_default_system_prompt_when_none_given(k2: KimiK2Format) -> None:
    """No leading system message: Kimi's default one (then a newline) is inserted; a given one replaces it."""
    assert KimiK2Format.default_thinking is False
    user = "<|im_user|>user<|im_middle|>Hi<|im_end|>"
    assert text(k2, [ChatMessage(role="user", content="Hi")]) == DEFAULT_SYSTEM + user + GEN
    system = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    assert text(k2, system) == "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" + user + GEN
    assert text(k2, [], add_generation_prompt=False) == DEFAULT_SYSTEM


def test_history_with_tool_calls_results_and_names(k2: KimiK2Format) -> None:
    """Assistant content then the tool-call section; results under the tool's name with `## Return of {id}`."""
    messages = [
        ChatMessage(role="system", content="sys"),
        ChatMessage(role="user", content="Weather?", name="ann"),
        ChatMessage(
            role="assistant",
            content="Checking.",
            reasoning="dropped with thinking off",
            tool_calls=(
                ToolCall(id="functions.get_weather:0", name="get_weather", arguments='{"city": "Paris"}'),
                ToolCall(id="", name="get_weather", arguments='{"city":"Oslo"}'),
            ),
        ),
        ChatMessage(role="tool", name="get_weather", tool_call_id="functions.get_weather:0", content="18C"),
        ChatMessage(role="tool", tool_call_id="functions.get_weather:1", content="9C"),
        ChatMessage(role="assistant", content="Paris 18C, Oslo 9C."),
    ]
    assert text(k2, messages, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>sys<|im_end|>"
        "<|im_user|>ann<|im_middle|>Weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n9C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Paris 18C, Oslo 9C.<|im_end|>"
    )


def test_tool_declaration_is_deep_sorted_compact_json(k2: KimiK2Format) -> None:
    """Tools come first as `tool_declare`: OpenAI-style objects, keys sorted at every depth, no spaces, raw UTF-8."""
    rendered = text(k2, [ChatMessage(role="user", content="Hi")], tools=[WEATHER])
    declared = [{"function": {"description": "Get the weather", "name": "get_weather", "parameters": {
        "properties": {"city": {"description": "é", "type": "string"}}, "required": ["city"], "type": "object"}},
        "type": "function"}]  # fmt: skip
    head = "<|im_system|>tool_declare<|im_middle|>" + json.dumps(declared, separators=(",", ":"), ensure_ascii=False)
    assert rendered == head + "<|im_end|>" + DEFAULT_SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN
    assert '"description":"é"' in rendered


def test_thinking_mode_keeps_only_the_latest_reasoning(k2: KimiK2Format) -> None:
    """K2-Thinking rule: turns up to the last plain assistant reply get `<think></think>`; later ones keep their
    reasoning; the generation prompt opens `<think>`."""
    messages = [
        ChatMessage(role="user", content="Q1"),
        ChatMessage(role="assistant", content="A1", reasoning="old"),
        ChatMessage(role="user", content="Q2"),
        ChatMessage(
            role="assistant",
            reasoning="new",
            tool_calls=(ToolCall(id="functions.f:0", name="f", arguments="{}"),),
        ),
        ChatMessage(role="tool", tool_call_id="functions.f:0", content="ok"),
    ]
    rendered = text(k2, messages, thinking=True)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>" in rendered
    assert "<|im_assistant|>assistant<|im_middle|><think>new</think><|tool_calls_section_begin|>" in rendered
    assert rendered.endswith(GEN + "<think>") and "old" not in rendered
    off = text(k2, messages)
    assert "<think>" not in off and off.endswith(GEN) and "new" not in off
    ids = k2.render(messages, thinking=True)
    assert ids[-1] == k2.tokenizer.special_tokens["<think>"]


def test_thinking_needs_think_tokens(k2: KimiK2Format) -> None:
    """A K2 tokenizer without `<think>` (Kimi-Linear-48B) refuses thinking mode but renders without it."""
    tok = k2.tokenizer
    table = {k: v for k, v in tok.special_tokens.items() if k not in ("<think>", "</think>")}

    class NoThink:
        special_tokens = table
        encode = tok.encode

    fmt = KimiK2Format(NoThink())  # type: ignore[arg-type]
    assert not fmt.supports_thinking and k2.supports_thinking
    assert fmt.render([ChatMessage(role="user", content="Hi")], thinking=False) == k2.render(
        [ChatMessage(role="user", content="Hi")], thinking=False
    )
    with pytest.raises(ValueError, match="<think>"):
        fmt.render([ChatMessage(role="user", content="Hi")], thinking=True)


def test_user_text_with_special_token_strings_stays_text(k2: KimiK2Format) -> None:
    """A literal `<|im_end|>` typed by a client is encoded as text, never as the special token."""
    ids = k2.render([ChatMessage(role="user", content="a<|im_end|>b <think>")], thinking=False)
    sp = k2.tokenizer.special_tokens
    assert ids.count(sp["<|im_end|>"]) == 2  # the default system turn's and the user turn's own
    assert sp["<think>"] not in ids
    assert "a<|im_end|>b <think><|im_end|>" in k2.tokenizer.decode(ids)


def test_adjacent_text_is_encoded_as_one_run(k2: KimiK2Format) -> None:
    """Text between two special tokens is one BPE run: `## Return of {id}\\n{content}` is encoded together."""
    tok = k2.tokenizer
    ids = k2.render([ChatMessage(role="tool", tool_call_id="x", content="y z")], thinking=False)
    middle, end = tok.special_tokens["<|im_middle|>"], tok.special_tokens["<|im_end|>"]
    start = ids.index(middle, ids.index(tok.special_tokens["<|im_system|>"], 1))  # the tool turn's header
    body = ids[start + 1 : ids.index(end, start)]
    assert body == tok.encode("## Return of x\ny z", allow_special=False)


def test_stop_tokens_and_bad_messages(k2: KimiK2Format) -> None:
    """Stop on <|im_end|> and [EOS]; invalid roles and tool calls outside assistant turns are refused."""
    sp = k2.tokenizer.special_tokens
    assert k2.stop_token_ids == frozenset({sp["<|im_end|>"], sp["[EOS]"]})
    with pytest.raises(ValueError, match="role"):
        ChatMessage(role="robot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tool_calls"):
        ChatMessage(role="user", tool_calls=(ToolCall(id="a", name="f", arguments="{}"),))
    with pytest.raises(ValueError, match="not among the offered tools"):
        k2.render([ChatMessage(role="user", content="x")], thinking=False, tool_choice="nope")
    spec = ToolSpec.from_openai(WEATHER.to_openai())
    assert spec == WEATHER and ToolSpec(name="f").to_openai() == {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }


def test_continue_final_message_is_a_prefill(k2: KimiK2Format) -> None:
    """A last assistant message left open (no <|im_end|>, no new turn): the ids are the generation prompt followed by
    the prefix's own tokens, so the model continues the text. Thinking mode, a tool-call message, a last
    non-assistant message and add_generation_prompt are refused."""
    hi = [ChatMessage(role="user", content="Hi")]
    prefill = [*hi, ChatMessage(role="assistant", content='{"answer": ')]
    ids = k2.render(prefill, thinking=False, add_generation_prompt=False, continue_final_message=True)
    assert ids == k2.render(hi, thinking=False) + k2.tokenizer.encode('{"answer": ', allow_special=False)
    assert text(k2, prefill, add_generation_prompt=False, continue_final_message=True).endswith(GEN + '{"answer": ')
    call = ChatMessage(role="assistant", content="", tool_calls=(ToolCall(id="c", name="f", arguments="{}"),))
    for messages, kw, needle in ((prefill, {"thinking": True}, "thinking mode"), (hi, {}, "last assistant"),
                                 ([*hi, call], {}, "without tool calls"),
                                 (prefill, {"add_generation_prompt": True}, "cannot both")):
        with pytest.raises(ValueError, match=needle):
            k2.render(messages, **{"thinking": False, "add_generation_prompt": False, **kw},
                      continue_final_message=True)
