"""End to end: request and response bodies against the OpenAI spec (../shared/data/openapi/openai-openapi.yaml), and
the requests the API must refuse or accept (explicit nulls, null content, tools without a schema, unsatisfiable JSON
schemas, too many stop strings, prompts far beyond the context)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

SPEC = Path(__file__).resolve().parents[3] / "shared" / "data" / "openapi" / "openai-openapi.yaml"
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}, "required": ["city"],
    "additionalProperties": False}}}


def _openapi_to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema (`anyOf` with null); everything else as it is."""
    if isinstance(node, list):
        return [_openapi_to_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi_to_json_schema(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


@pytest.fixture(scope="module")
def spec() -> dict[str, jsonschema.protocols.Validator]:
    """A validator per response schema, $refs resolved within the spec's components."""
    if not SPEC.exists():
        pytest.skip(f"the OpenAI spec is not at {SPEC}")
    with SPEC.open() as f:
        schemas = _openapi_to_json_schema(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
                                          ["components"]["schemas"])
    # Streamed completions carry `"finish_reason": null` until the last chunk and `"usage": null` before the usage
    # chunk, as OpenAI's own API sends them; the spec describes the whole response, where neither is null.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
    schemas["CompletionStreamChunk"] = chunk
    return {name: jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                                   "components": {"schemas": schemas}})
            for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                         "CreateCompletionResponse", "CompletionStreamChunk")}


def _post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=120)


def _events(server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a stream (the final [DONE] checked and dropped)."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=server.headers(),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _check(validator: jsonschema.protocols.Validator, body: dict[str, Any]) -> None:
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5])


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}
CHAT_CASES = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "logprobs-0": {"logprobs": True, "top_logprobs": 0},
    "n-usage": {"n": 2, "temperature": 1.0, "seed": 3, "stream_options": {"include_usage": True}},
    "forced-tool": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                    "max_tokens": 40},
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_responses_follow_the_spec(server, spec, case):
    body = {**CHAT, **CHAT_CASES[case]}
    if case != "n-usage":
        whole = _post(server, "/v1/chat/completions", body)
        assert whole.status_code == 200, whole.text
        _check(spec["CreateChatCompletionResponse"], whole.json())
        message = whole.json()["choices"][0]["message"]
        assert "refusal" in message and message["refusal"] is None
        if case.startswith("logprobs"):
            assert whole.json()["choices"][0]["logprobs"]["refusal"] is None
            assert all(len(t["top_logprobs"]) == body["top_logprobs"]
                       for t in whole.json()["choices"][0]["logprobs"]["content"])
        if case == "forced-tool":
            assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    for event in _events(server, "/v1/chat/completions", body):
        _check(spec["CreateChatCompletionStreamResponse"], event)


COMPLETION = {"model": "tiny", "prompt": "The cache", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
COMPLETION_CASES = {
    "plain": {},
    "logprobs-0": {"logprobs": 0},
    "logprobs-2-n": {"logprobs": 2, "n": 2, "temperature": 1.0, "seed": 1},
    "batch-usage": {"prompt": ["One", "Two"], "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_completion_responses_follow_the_spec(server, spec, case):
    body = {**COMPLETION, **COMPLETION_CASES[case]}
    whole = _post(server, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    _check(spec["CreateCompletionResponse"], whole.json())
    if "logprobs" in body:
        for choice in whole.json()["choices"]:
            tops = choice["logprobs"]["top_logprobs"]
            assert len(tops) == 5 and all(isinstance(t, dict) and (len(t) <= body["logprobs"]) for t in tops)
            assert body["logprobs"] or all(t == {} for t in tops)  # objects, not nulls, for logprobs 0
    for event in _events(server, "/v1/completions", body):
        _check(spec["CompletionStreamChunk"], event)


NULLABLE_CHAT = ["logprobs", "n", "stream", "top_logprobs", "stop", "temperature", "top_p", "max_tokens",
                 "max_completion_tokens", "presence_penalty", "frequency_penalty", "seed", "user", "response_format",
                 "tools", "tool_choice", "stream_options", "logit_bias", "parallel_tool_calls", "reasoning_effort"]
NULLABLE_COMPLETION = ["logprobs", "n", "stream", "stop", "temperature", "top_p", "max_tokens", "presence_penalty",
                       "frequency_penalty", "seed", "user", "stream_options", "logit_bias", "echo", "best_of",
                       "suffix"]


def test_explicit_nulls_mean_not_given(server):
    """Every field the spec marks nullable (and vLLM's extras) may be null: as if it were absent."""
    chat = _post(server, "/v1/chat/completions", {**CHAT, **dict.fromkeys(NULLABLE_CHAT), "max_tokens": 3,
                                                  "min_tokens": None, "ignore_eos": None, "priority": None,
                                                  "messages": [{"role": "user", "content": "Hi", "name": None}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    completion = _post(server, "/v1/completions", {**COMPLETION, **dict.fromkeys(NULLABLE_COMPLETION),
                                                   "max_tokens": 3})
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1 and completion.json()["choices"][0]["logprobs"] is None
    message = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hi"}], "temperature": None, "top_p": None, "top_k": None, "stream": None,
        "stop_sequences": None, "system": None, "tools": None, "tool_choice": None, "metadata": None,
        "thinking": None})
    assert message.status_code == 200, message.text
    assert message.json()["type"] == "message"


def test_required_fields_stay_required(server):
    r = _post(server, "/v1/chat/completions", {**CHAT, "messages": None})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_message_with_null_content_is_a_400(server, role):
    messages = [{"role": role, "content": None, "tool_call_id": "call_1"}, {"role": "user", "content": "Hi"}]
    r = _post(server, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content"
    assistant = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert _post(server, "/v1/chat/completions", {**CHAT, "messages": assistant}).status_code == 200


def test_an_anthropic_tool_without_input_schema_is_a_400(server):
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "get_weather", "description": "Weather."}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert "tools.0.input_schema" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unsatisfiable_schema_is_refused_before_generating(server, stream):
    """A schema that requires itself forever compiles, yet no value fits it: 400 before any stream starts."""
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": RECURSIVE}}
    r = _post(server, "/v1/chat/completions", {**CHAT, "response_format": fmt, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_structured_output" and "no finite value" in r.text
    tool = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}
    r = _post(server, "/v1/chat/completions", {**CHAT, "tools": [TOOL, tool], "tool_choice": "required",
                                                "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1]"
    r = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 3, "stream": stream, "messages": [
        {"role": "user", "content": "Hi"}], "output_config": {"format": {"type": "json_schema", "schema": RECURSIVE}}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    # recursion with a way out is fine
    ok = {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]}
    r = _post(server, "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "tree", "schema": ok}}})
    assert r.status_code == 200, r.text


def test_stop_strings_are_capped(server):
    """--max-stop-sequences (default 16, above OpenAI's 4): more is a 400 naming the field."""
    stops = [f"stop{i}" for i in range(16)]
    assert _post(server, "/v1/completions", {**COMPLETION, "stop": stops}).status_code == 200
    r = _post(server, "/v1/completions", {**COMPLETION, "stop": [*stops, "one more"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = _post(server, "/v1/chat/completions", {**CHAT, "stop": [*stops, "one more"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hi"}], "stop_sequences": [*stops, "one more"]})
    assert r.status_code == 400 and "stop_sequences" in r.json()["error"]["message"], r.text


def test_text_far_beyond_the_context_is_refused_before_tokenizing(server):
    """Over max_model_len x (the longest token's bytes) characters cannot fit whatever the tokenization: a 400
    naming the limit, OpenAI's context_length_exceeded (the test server: 2,048 tokens, a 300 kB body limit)."""
    text = "x" * 250_000
    for path, body in (("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {**COMPLETION, "prompt": text})):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "2048 tokens" in error["message"]
        assert error["param"] == ("messages" if "chat" in path else "prompt")
    r = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": text}]})
    assert r.status_code == 400 and "2048 tokens" in r.json()["error"]["message"], r.text
