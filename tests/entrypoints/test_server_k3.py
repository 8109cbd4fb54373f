"""A live server on a tiny Kimi K3 checkpoint (XTML chat format): the request's response_format and tool_choice reach
the prompt as K3's internal system messages, through both APIs. The prompt ids come from /tokenize (the same
rendering as chat completions) and are compared token for token with the format's own rendering; the usage of a
real generation request confirms the generation route built the same prompt."""

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
OPENAI_TOOLS = [{"type": "function", "function": {"name": TOOL.name, "parameters": TOOL.parameters}}]
HI = [ChatMessage(role="user", content="hi")]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def k3(tiny_dir, tmp_path_factory):
    path = tiny_dir("k3")
    live = start_server(path, tmp_path_factory.mktemp("k3-server"), "--max-model-len", "1024")
    fmt = get_chat_format(path, Tokenizer.from_pretrained(path))
    yield live, fmt
    stop_server(live)


def _usage_prompt_tokens(server, path: str, body: dict) -> int:
    resp = _post(server, path, body)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def _chat_prompt(server, body: dict) -> list[int]:
    """The prompt ids of a chat request (from /tokenize), after checking that generation used as many."""
    ids = _post(server, "/tokenize", body).json()["tokens"]
    assert _usage_prompt_tokens(server, "/v1/chat/completions", {**body, "max_tokens": 2}) == len(ids)
    return ids


@pytest.mark.parametrize("response_format, declared", [
    ({"type": "json_object"}, StructuredOutput("json_object")),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"type": "text"}, None),
])
def test_openai_response_format_is_declared_in_the_prompt(k3, response_format, declared):
    """The prompt is exactly K3's rendering with that response_format (its internal response-format message; none
    for "text")."""
    server, fmt = k3
    ids = _chat_prompt(server, {"model": "tiny", "messages": USER, "response_format": response_format})
    assert ids == fmt.render(HI, thinking=fmt.default_thinking, response_format=declared)
    if declared is not None:
        assert len(ids) > len(fmt.render(HI, thinking=fmt.default_thinking))


def test_structured_outputs_constrain_without_declaring(k3):
    """vLLM's structured_outputs only constrain sampling; the prompt is the plain one."""
    server, fmt = k3
    ids = _chat_prompt(server, {"model": "tiny", "messages": USER, "structured_outputs": {"json": SCHEMA}})
    assert ids == fmt.render(HI, thinking=fmt.default_thinking)


@pytest.mark.parametrize("extra, tool_choice", [
    ({}, None),  # a plain request: no tools, no tool_choice, no message (the server once added "MUST NOT")
    ({"tools": OPENAI_TOOLS}, None),  # tools without tool_choice: auto, no message
    ({"tools": OPENAI_TOOLS, "tool_choice": "none"}, "none"),  # sent by the client: declared
    ({"tools": OPENAI_TOOLS, "tool_choice": "required"}, "required"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": TOOL.name}}}, TOOL.name),
])
def test_tool_choice_is_declared_only_when_sent(k3, extra, tool_choice):
    """The prompt is K3's rendering with exactly the tool_choice the client sent (a named one adds no message)."""
    server, fmt = k3
    ids = _chat_prompt(server, {"model": "tiny", "messages": USER, **extra})
    tools = [TOOL] if "tools" in extra else []
    assert ids == fmt.render(HI, tools=tools, thinking=fmt.default_thinking, tool_choice=tool_choice)
    if tool_choice in ("none", "required"):
        assert len(ids) > len(fmt.render(HI, tools=tools, thinking=fmt.default_thinking))


def test_anthropic_output_format_and_tool_choice_are_declared(k3):
    """/v1/messages: output_config.format is K3's json_schema response format; tool_choice any is 'required'
    (count_tokens and the usage of a real request agree with the rendering); a forced tool with an output format is
    a 400."""
    server, fmt = k3
    base = {"model": "tiny", "messages": USER}
    thinking = fmt.default_thinking
    schema_body = {**base, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    forced = {**base, "tools": [{"name": TOOL.name, "input_schema": TOOL.parameters}], "tool_choice": {"type": "any"}}
    expected = [
        (schema_body, fmt.render(HI, thinking=thinking,
                                 response_format=StructuredOutput("json_schema", json.dumps(SCHEMA)))),
        (forced, fmt.render(HI, tools=[TOOL], thinking=thinking, tool_choice="required")),
    ]
    for body, ids in expected:
        assert _post(server, "/v1/messages/count_tokens", body).json()["input_tokens"] == len(ids)
        assert _usage_prompt_tokens(server, "/v1/messages", {**body, "max_tokens": 2}) == len(ids)
    resp = _post(server, "/v1/messages", {**forced, "max_tokens": 2, "output_config": schema_body["output_config"]})
    assert resp.status_code == 400 and "output_config.format" in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize("extra, effort", [
    ({}, None), ({"reasoning_effort": "low"}, "low"), ({"chat_template_kwargs": {"thinking_effort": "high"}}, "high"),
])
def test_reasoning_effort_is_the_k3_thinking_effort(k3, extra, effort):
    """OpenAI's reasoning_effort (or chat_template_kwargs.thinking_effort) replaces the default "max" in K3's
    thinking-effort message; an unknown effort is a 400."""
    server, fmt = k3
    ids = _chat_prompt(server, {"model": "tiny", "messages": USER, **extra})
    assert ids == fmt.render(HI, thinking=True, thinking_effort=effort)
    if effort is not None:
        assert ids != fmt.render(HI, thinking=True)
    resp = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "reasoning_effort": "extreme"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "reasoning_effort", resp.text
