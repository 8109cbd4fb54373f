"""Kimi K3 XTML rendering against golden strings derived from NeMo's `kimi_k3/encoding.py` (`build_chat_segments`).

Goldens were written by following NVIDIA-NeMo/Automodel `nemo_automodel/components/models/kimi_k3/encoding.py`
(commit 00ef9ca2) by hand; `tokenization.py`'s `apply_chat_template` adds the thinking-effort message ("max").
"""

from __future__ import annotations

import pytest

from deltaserve.chat import ChatMessage, KimiK3Format, ToolSpec
from deltaserve.chat.kimi_k3 import resolve_tool_results
from deltaserve.parsers.types import ToolCall
from deltaserve.sampling_params import StructuredOutput

EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
    "your thinking channel (not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)
USER_HI = '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
WEATHER = ToolSpec(
    name="get_weather",
    description="Weather now",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def text(fmt: KimiK3Format, messages: list[ChatMessage], **kw) -> str:
    kw.setdefault("thinking", False)
    ids = fmt.render(messages, **kw)
    assert ids == fmt.encode(fmt.segments(messages, **kw))
    return fmt.tokenizer.decode(ids)


def call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


def test_user_turn_thinking_default_and_off(k3: KimiK3Format) -> None:
    """Thinking mode announces the effort and opens `think`; non-thinking opens `response` and says nothing else."""
    assert KimiK3Format.default_thinking is True
    assert text(k3, [ChatMessage(role="user", content="Hi")], thinking=True) == EFFORT + USER_HI + GEN_THINK
    assert text(k3, [ChatMessage(role="user", content="Hi")]) == USER_HI + GEN_RESPONSE
    quiet = KimiK3Format(k3.tokenizer, thinking_effort=None)
    assert text(quiet, [ChatMessage(role="user", content="Hi")], thinking=True) == USER_HI + GEN_THINK
    assert text(k3, [ChatMessage(role="user", content="Hi")], add_generation_prompt=False) == USER_HI


def test_system_user_names_and_attribute_escaping(k3: KimiK3Format) -> None:
    """System and user messages, a `name` attribute, and `&` / `"` escaped in attribute values only."""
    messages = [
        ChatMessage(role="system", content="Be brief & exact."),
        ChatMessage(role="user", content='He said "hi" & left', name='R&D "lab"'),
    ]
    assert text(k3, messages) == (
        '<|open|>message role="system"<|sep|>Be brief & exact.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user" name="R&amp;D &quot;lab&quot;"<|sep|>He said "hi" & left'
        "<|close|>message<|sep|><|end_of_msg|>" + GEN_RESPONSE
    )


def test_tool_conversation_matches_the_spec_example(k3: KimiK3Format) -> None:
    """Tool declaration (sorted, compact JSON), a call with a string argument, its result (model-spec §12.2)."""
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(
            role="assistant", reasoning="Look it up.", tool_calls=(call("c1", "get_weather", '{"city": "Paris"}'),)
        ),
        ChatMessage(role="tool", tool_call_id="c1", content='{"temp_c": 18}'),
    ]
    declared = (
        '[{"function":{"description":"Weather now","name":"get_weather","parameters":{"properties":{"city":'
        '{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]'
    )
    assert text(k3, messages, tools=[WEATHER], thinking=True) == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
        f"JSONSchema.\n\n```json\n{declared}\n```<|close|>message<|sep|><|end_of_msg|>"
        + EFFORT
        + '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Look it up.<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp_c": 18}<|close|>message<|sep|>'
        "<|end_of_msg|>" + GEN_THINK
    )


def test_think_channel_is_structural_in_thinking_mode_only(k3: KimiK3Format) -> None:
    """Every assistant turn has a think block in thinking mode (empty when the reasoning is blank), none otherwise."""
    messages = [
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content="Hello!", reasoning="  \n"),
        ChatMessage(role="user", content="Hi"),
    ]
    body = "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    opening = '<|open|>message role="assistant"<|sep|>'
    think = "<|open|>think<|sep|><|close|>think<|sep|>"
    assert text(k3, messages, thinking=True) == EFFORT + USER_HI + opening + think + body + USER_HI + GEN_THINK
    assert text(k3, messages) == USER_HI + opening + body + USER_HI + GEN_RESPONSE


def test_typed_arguments_and_unparsable_arguments(k3: KimiK3Format) -> None:
    """Strings raw, other JSON values re-dumped with Python's default separators; non-JSON text in a json block."""
    arguments = '{"s": "x y", "n": 1.5, "i": 3, "b": true, "z": null, "o": {"a": [1,2]}, "l": ["q"]}'
    messages = [ChatMessage(role="assistant", tool_calls=(call("a", "f", arguments), call("b", "g", "not json")))]
    args = "".join(
        f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'
        for k, t, v in [
            ("s", "string", "x y"),
            ("n", "number", "1.5"),
            ("i", "number", "3"),
            ("b", "boolean", "true"),
            ("z", "null", "null"),
            ("o", "object", '{"a": [1, 2]}'),
            ("l", "array", '["q"]'),
        ]
    )
    assert text(k3, messages, add_generation_prompt=False) == (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        f'<|open|>call tool="f" index="1"<|sep|>{args}<|close|>call<|sep|>'
        '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    with pytest.raises(ValueError, match="JSON object"):
        k3.render([ChatMessage(role="assistant", tool_calls=(call("a", "f", "[1, 2]"),))], thinking=False)


def _results(k3: KimiK3Format, messages: list[ChatMessage]) -> list[str]:
    rendered = text(k3, messages, add_generation_prompt=False)
    return [m.split("<|sep|>")[0] + "|" + m.split("<|sep|>")[1] for m in rendered.split("<|open|>message ")[1:]][1:]


def test_tool_results_are_reordered_into_call_order(k3: KimiK3Format) -> None:
    """Results sent out of order are sorted by their call's position and named after the call (NeMo's rule)."""
    calls = (call("c-a", "alpha", "{}"), call("c-b", "beta", "{}"))
    messages = [
        ChatMessage(role="assistant", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="c-b", name="stale", content="B"),
        ChatMessage(role="tool", tool_call_id="c-a", content="A"),
    ]
    assert _results(k3, messages) == [
        'role="tool" tool="alpha" index="1"|A<|close|>message',
        'role="tool" tool="beta" index="2"|B<|close|>message',
    ]
    assert [m.content for m, _ in resolve_tool_results(messages)] == ["", "A", "B"]


def test_unmatched_tool_result_run_keeps_its_order(k3: KimiK3Format) -> None:
    """One unknown id leaves the run as sent: names come from the message, else from the call at that position."""
    calls = (call("c-a", "alpha", "{}"), call("c-b", "beta", "{}"))
    messages = [
        ChatMessage(role="assistant", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="zzz", content="B"),
        ChatMessage(role="tool", tool_call_id="c-a", name="alpha", content="A"),
    ]
    assert _results(k3, messages) == [
        'role="tool" tool="alpha" index="1"|B<|close|>message',
        'role="tool" tool="alpha" index="2"|A<|close|>message',
    ]
    orphan = [ChatMessage(role="user", content="x"), ChatMessage(role="tool", content="?")]
    with pytest.raises(ValueError, match="tool name"):
        k3.render(orphan, thinking=False)


def test_internal_tool_choice_and_response_format_messages(k3: KimiK3Format) -> None:
    """tool_choice required / none and json response formats append K3's fixed internal system messages."""
    hi = [ChatMessage(role="user", content="Hi")]

    def internal(kind: str, body: str) -> str:
        return f'<|open|>message role="system" type="{kind}"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'

    required = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
    none = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
    raw = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    assert text(k3, hi, tools=[WEATHER], tool_choice="required").endswith(
        USER_HI + internal("tool-choice", required) + GEN_RESPONSE
    )
    assert text(k3, hi, tools=[WEATHER], tool_choice="none").endswith(internal("tool-choice", none) + GEN_RESPONSE)
    assert text(k3, hi, tools=[WEATHER], tool_choice="get_weather").endswith(USER_HI + GEN_RESPONSE)
    json_object = StructuredOutput("json_object")
    assert (
        text(k3, hi, response_format=json_object)
        == USER_HI
        + internal("response-format", f"The system is invoked with `response_format=json_object`.\n{raw}")
        + GEN_RESPONSE
    )
    schema = StructuredOutput("json_schema", '{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert (
        text(k3, hi, tool_choice="none", response_format=schema)
        == USER_HI
        + internal("tool-choice", none)
        + internal(
            "response-format",
            f"The system is invoked with `response_format=json_schema`.\n{raw}\nThe JSON data must match the following "
            'schema:\n```json\n{"properties":{"a":{},"b":{}},"type":"object"}\n```',
        )
        + GEN_RESPONSE
    )
    with pytest.raises(ValueError, match="not among the offered tools"):
        k3.render(hi, tools=[WEATHER], thinking=False, tool_choice="nope")


def test_segments_are_encoded_one_by_one(k3: KimiK3Format) -> None:
    """Ids are the concatenation of per-segment encodings, which differs from encoding the prompt text whole."""
    messages = [ChatMessage(role="user", content="Hi <|end_of_msg|>", name=":")]
    doc = k3.segments(messages, thinking=False)
    ids = k3.render(messages, thinking=False)
    tok = k3.tokenizer
    expected = []
    for segment, special in doc.items:
        expected += [tok.special_tokens[segment]] if special else tok.encode(segment, allow_special=False)
    assert ids == expected and tok.decode(ids) == str(doc)
    assert '<|open|>message role="user" name=":"<|sep|>Hi <|end_of_msg|><|close|>' in str(doc)
    assert ids.count(tok.special_tokens["<|end_of_msg|>"]) == 1  # the typed marker stayed text
    whole = tok.encode(str(doc).replace("Hi <|end_of_msg|>", "Hi"), allow_special=True)
    assert k3.render([ChatMessage(role="user", content="Hi", name=":")], thinking=False) != whole
    assert tok.decode(whole) == str(k3.segments([ChatMessage(role="user", content="Hi", name=":")], thinking=False))


def test_k3_stop_tokens_and_effort_validation(k3: KimiK3Format) -> None:
    """Stop on <|end_of_msg|> and [EOS]; an unknown thinking effort is refused."""
    sp = k3.tokenizer.special_tokens
    assert k3.stop_token_ids == frozenset({sp["<|end_of_msg|>"], sp["[EOS]"]})
    with pytest.raises(ValueError, match="thinking_effort"):
        KimiK3Format(k3.tokenizer, thinking_effort="huge")


def test_continue_final_message_is_a_prefill(k3: KimiK3Format) -> None:
    """K3's last assistant message left open inside its response channel: the generation prompt (non-thinking)
    followed by the prefix text; an internal tool-choice or response-format message (which would follow the open
    message) is refused."""
    hi = [ChatMessage(role="user", content="Hi")]
    prefill = [*hi, ChatMessage(role="assistant", content="Sure, ")]
    ids = k3.render(prefill, thinking=False, add_generation_prompt=False, continue_final_message=True)
    assert ids == k3.render(hi, thinking=False) + k3.tokenizer.encode("Sure, ", allow_special=False)
    assert text(k3, prefill, thinking=False, add_generation_prompt=False,
                continue_final_message=True).endswith(GEN_RESPONSE + "Sure, ")
    for kw in ({"tool_choice": "none"}, {"response_format": StructuredOutput("json_object")}):
        with pytest.raises(ValueError, match="prefill"):
            k3.render(prefill, thinking=False, add_generation_prompt=False, continue_final_message=True, **kw)
    with pytest.raises(ValueError, match="thinking mode"):
        k3.render(prefill, thinking=True, add_generation_prompt=False, continue_final_message=True)
