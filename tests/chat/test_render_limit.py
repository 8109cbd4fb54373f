"""`ChatFormat.render(max_tokens=...)`: a prompt within the limit renders exactly as without it; one past it raises
TokenLimitExceeded without tokenizing the rest (how the server refuses a prompt of megabytes past its context)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.chat import ChatMessage, KimiK2Format, KimiK3Format, ToolSpec
from deltaserve.chat.format import ChatFormat
from deltaserve.parsers.types import ToolCall
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer, TokenLimitExceeded

WEATHER = ToolSpec(name="get_weather", description="Weather now",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}}})
CONVERSATION = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris and 中文?"),
    ChatMessage(role="assistant", content="", tool_calls=(ToolCall(id="functions.get_weather:0", name="get_weather",
                                                                   arguments='{"city": "Paris"}'),)),
    ChatMessage(role="tool", content="sunny", tool_call_id="functions.get_weather:0"),
    ChatMessage(role="user", content="thanks " * 500),
]


@pytest.fixture(params=["k2", "k3"])
def fmt(request: pytest.FixtureRequest) -> ChatFormat:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_prompt_within_max_tokens_renders_exactly(fmt: ChatFormat, thinking: bool) -> None:
    """max_tokens = the prompt's length (or more) changes nothing; one less raises TokenLimitExceeded naming it."""
    if thinking and isinstance(fmt, KimiK2Format) and not fmt.supports_thinking:
        pytest.skip("this K2 tokenizer has no think tokens")
    full = fmt.render(CONVERSATION, tools=[WEATHER], thinking=thinking)
    assert len(full) > 500
    for limit in (len(full), len(full) + 1, 10 * len(full)):
        assert fmt.render(CONVERSATION, tools=[WEATHER], thinking=thinking, max_tokens=limit) == full
    for limit in (len(full) - 1, 3, 0):
        with pytest.raises(TokenLimitExceeded) as info:
            fmt.render(CONVERSATION, tools=[WEATHER], thinking=thinking, max_tokens=limit)
        assert info.value.limit == limit


def test_the_limit_counts_special_ids_after_the_last_text(fmt: ChatFormat) -> None:
    """The generation prompt's special ids count: a limit the text fits but the whole prompt does not is refused."""
    messages = [ChatMessage(role="user", content="Hi")]
    full = fmt.render(messages, thinking=False)
    assert fmt.render(messages, thinking=False, max_tokens=len(full)) == full
    with pytest.raises(TokenLimitExceeded):
        fmt.render(messages, thinking=False, max_tokens=len(full) - 1)  # the last id is a special one


@pytest.mark.parametrize("flavor", ["k2", "k3"])
def test_a_prompt_far_past_max_tokens_is_not_tokenized_whole(flavor: str, tmp_path: Path, monkeypatch) -> None:
    """A 2.2M-character message with max_tokens 1,000 (Kimi's tiktoken format): tokenizing stops after the first
    400k-character piece of it, a fifth of the tokens the whole message has."""
    write_tiny_tokenizer(tmp_path, 1024, fmt="tiktoken", flavor=flavor)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    fmt = KimiK2Format(tokenizer) if flavor == "k2" else KimiK3Format(tokenizer)
    produced: list[int] = []
    encode_piece = tokenizer._backend._encode_piece

    def counting(piece, allowed):
        array = encode_piece(piece, allowed)
        produced.append(len(array))
        return array

    monkeypatch.setattr(tokenizer._backend, "_encode_piece", counting)
    messages = [ChatMessage(role="user", content="the scheduler gives each request tokens under a budget; " * 40_000)]
    whole = len(fmt.render(messages, thinking=False))
    produced.clear()
    with pytest.raises(TokenLimitExceeded):
        fmt.render(messages, thinking=False, max_tokens=1000)
    assert sum(produced) < whole / 5
