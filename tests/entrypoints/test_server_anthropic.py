"""End to end: the official `anthropic` SDK against a live `deltaserve serve` (/v1/messages)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.entrypoints.server_fixture import API_KEY
from tests.entrypoints.test_server_openai import WEATHER_SCHEMA

TOOLS = [
    {"name": "get_weather", "description": "Weather forecast for a city.", "input_schema": WEATHER_SCHEMA},
    {
        "name": "noop",
        "description": "Does nothing.",
        "input_schema": {"type": "object", "properties": {}, "additionalProperties": False},
    },
]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def test_message_text_and_usage(client):
    msg = client.messages.create(
        model="tiny",
        max_tokens=8,
        system="Be brief.",
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hello there"}],
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= msg.usage.output_tokens <= 8 and msg.usage.input_tokens > 0
    assert all(b.type == "text" for b in msg.content)


def test_stream_event_sequence_and_text(client):
    kwargs = dict(
        model="tiny",
        max_tokens=10,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me about tokens"}]}],
    )
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    opened = [e.index for e in events if e.type == "content_block_start"]
    closed = [e.index for e in events if e.type == "content_block_stop"]
    assert opened == closed == list(range(len(opened)))
    assert events[-2].usage.output_tokens == whole.usage.output_tokens


def test_thinking_stream_has_thinking_deltas(client):
    with client.messages.stream(
        model="tiny",
        max_tokens=6,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Think about it"}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas
    assert final.content[0].type == "thinking" and final.content[0].thinking


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(client, choice):
    kwargs = dict(
        model="tiny",
        max_tokens=150,
        extra_body={"temperature": 0.0},  # greedy: an unseeded sample of this random model may ramble past max_tokens
        tools=TOOLS,
        tool_choice=choice,
        messages=[{"role": "user", "content": "Weather in Tokyo?"}],
    )
    msg = client.messages.create(**kwargs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses
    for b in uses:
        assert b.name in ("get_weather", "noop") if choice["type"] == "any" else b.name == "get_weather"
        jsonschema.validate(b.input, next(t["input_schema"] for t in TOOLS if t["name"] == b.name))
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events) or all(
        not b.input for b in final.content if b.type == "tool_use"
    )
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed
    for b in streamed:
        jsonschema.validate(b.input, next(t["input_schema"] for t in TOOLS if t["name"] == b.name))


def test_multi_turn_with_tool_result(client):
    first = client.messages.create(
        model="tiny",
        max_tokens=150,
        extra_body={"temperature": 0},
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    use = next(b for b in first.content if b.type == "tool_use")
    second = client.messages.create(
        model="tiny",
        max_tokens=8,
        extra_body={"temperature": 0},
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"},
                    {"type": "text", "text": "Thanks, summarise."},
                ],
            },
        ],
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_stop_sequences_cut_the_text(client):
    base = dict(
        model="tiny", max_tokens=20, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Go on"}]
    )
    text = "".join(b.text for b in client.messages.create(**base).content if b.type == "text")
    if len(text) < 4:
        pytest.skip("the random model stopped too early to pick a stop sequence")
    stop = text[2:4]
    cut = client.messages.create(stop_sequences=[stop], **base)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


def test_output_config_json_schema(client):
    msg = client.messages.create(
        model="tiny",
        max_tokens=150,
        extra_body={"temperature": 0.8},
        output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}},
        messages=[{"role": "user", "content": "Plan as JSON"}],
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)
