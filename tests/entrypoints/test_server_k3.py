"""A live server on a tiny Kimi K3 checkpoint (XTML chat format): the request's response_format and tool_choice reach
the prompt as K3's internal system messages, through both APIs."""

from __future__ import annotations

import json

import pytest

from deltaserve.chat import get_chat_format
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer
from tests.entrypoints.server_fixture import start_server, stop_server
from tests.entrypoints.test_server_errors import _post

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = ToolSpec(name="get_weather", description="", parameters={"type": "object", "properties": {}})
HI = [ChatMessage(role="user", content="hi")]


@pytest.fixture(scope="module")
def k3(tiny_dir, tmp_path_factory):
    path = tiny_dir("k3")
    live = start_server(path, tmp_path_factory.mktemp("k3-server"), "--max-model-len", "1024")
    fmt = get_chat_format(path, Tokenizer.from_pretrained(path))
    yield live, fmt
    stop_server(live)


def _prompt_tokens(server, path: str, body: dict) -> int:
    resp = _post(server, path, body)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


@pytest.mark.parametrize("response_format, declared", [
    ({"type": "json_object"}, StructuredOutput("json_object")),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"type": "text"}, None),
])
def test_openai_response_format_is_declared_in_the_prompt(k3, response_format, declared):
    """The prompt the server built has exactly the tokens of the K3 template with that response_format (its
    internal response-format message), and the answer is constrained to JSON."""
    server, fmt = k3
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "response_format": response_format}
    expected = fmt.render(HI, thinking=fmt.default_thinking, response_format=declared)
    assert _prompt_tokens(server, "/v1/chat/completions", body) == len(expected)
    if declared is not None:
        assert len(expected) > len(fmt.render(HI, thinking=fmt.default_thinking))


def test_structured_outputs_constrain_without_declaring(k3):
    """vLLM's structured_outputs only constrain sampling; the prompt is the plain one."""
    server, fmt = k3
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "structured_outputs": {"json": SCHEMA}}
    assert _prompt_tokens(server, "/v1/chat/completions", body) == len(fmt.render(HI, thinking=fmt.default_thinking))


def test_anthropic_output_format_and_tool_choice_are_declared(k3):
    """/v1/messages: output_config.format is K3's json_schema response format; tool_choice any is 'required'; a
    forced tool with an output format is a 400."""
    server, fmt = k3
    base = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    thinking = fmt.default_thinking
    schema_body = {**base, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    expected = fmt.render(HI, thinking=thinking, response_format=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    assert _prompt_tokens(server, "/v1/messages", schema_body) == len(expected)
    tools = [{"name": TOOL.name, "input_schema": TOOL.parameters}]
    forced = {**base, "tools": tools, "tool_choice": {"type": "any"}}
    expected = fmt.render(HI, tools=[TOOL], thinking=thinking, tool_choice="required")
    assert _prompt_tokens(server, "/v1/messages", forced) == len(expected)
    resp = _post(server, "/v1/messages", {**forced, "output_config": schema_body["output_config"]})
    assert resp.status_code == 400 and "output_config.format" in resp.json()["error"]["message"], resp.text


def test_tool_choice_none_is_declared_only_when_sent(k3):
    """A request without tools (or without tool_choice) gets no tool-choice message; an explicit "none" does (the
    server used to add "You MUST NOT call any tools" to every plain request)."""
    server, fmt = k3
    tools = [{"type": "function", "function": {"name": TOOL.name, "parameters": TOOL.parameters}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    thinking = fmt.default_thinking
    sent = _prompt_tokens(server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert sent == len(fmt.render(HI, tools=[TOOL], thinking=thinking, tool_choice="none"))
    assert _prompt_tokens(server, "/v1/chat/completions", body) == len(fmt.render(HI, tools=[TOOL], thinking=thinking))
    assert sent > len(fmt.render(HI, tools=[TOOL], thinking=thinking))
