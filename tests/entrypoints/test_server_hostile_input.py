"""Inputs found by fuzzing the live server (session 6): each once crashed the engine, answered 500, or answered a
stream's 200 with an in-stream error. Each must now be a 4xx with a proper body, and the server must keep serving."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_fixture import start_server, stop_server
from tests.entrypoints.test_server_errors import CHAT, USER, _openai_error, _post, _still_serving

COMPLETIONS = "/v1/completions"


def _alive(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    _still_serving(server)


@pytest.mark.parametrize("extra, param", [
    ({"top_k": 2**63, "top_p": 0.9}, "top_k"),  # once killed the engine process (int64 overflow in the sampler)
    ({"seed": 2**64}, "seed"),  # once a 500 (msgpack could not encode it)
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
])
def test_integers_beyond_64_bits_are_rejected(server, extra, param):
    """Integers past int64 (or a seed past uint64) are a 400 naming the field; the engine stays up."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1.0, **extra}
    _openai_error(_post(server, COMPLETIONS, body), 400, param)
    _alive(server)


def test_large_in_range_integers_are_served(server):
    """top_k above the vocabulary keeps every token; n seeds past 2**64 - 1 wrap instead of overflowing."""
    for extra in ({"top_k": 2**62, "top_p": 0.9}, {"n": 2, "seed": 2**64 - 1}):
        resp = _post(server, COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra})
        assert resp.status_code == 200, resp.text


def test_json_constants_and_tiny_temperature(server):
    """NaN / Infinity literals are malformed JSON; a temperature below 1e-5 samples greedily."""
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    err = _openai_error(_post(server, COMPLETIONS, raw=raw), 400)
    assert "NaN" in err["message"]
    _openai_error(_post(server, COMPLETIONS, raw=raw.replace(b"NaN", b"Infinity")), 400)
    # Below 1e-5 the temperature is greedy (logits / 1e-45 overflowed to NaN and sampled token 0 every step).
    prompt = {"model": "tiny", "prompt": [5, 9, 33, 7], "max_tokens": 6, "ignore_eos": True}
    tiny = _post(server, COMPLETIONS, {**prompt, "temperature": 1e-45}).json()["choices"][0]["text"]
    greedy = _post(server, COMPLETIONS, {**prompt, "temperature": 0}).json()["choices"][0]["text"]
    assert tiny == greedy


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"model": "tiny", "prompt": "\ud800", "max_tokens": 2}),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["\ud800"]}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "system": "\ud800", "messages": USER}),
])
def test_lone_surrogates_are_rejected(server, path, body):
    """A lone surrogate written as an escape, in a prompt, a message, a stop string or a system prompt: 400."""
    resp = _post(server, path, body)  # json.dumps writes them as \ud800 escapes
    assert resp.status_code == 400, resp.text
    assert "surrogate" in resp.text
    _alive(server)


def test_surrogates_and_non_utf8_as_raw_bytes_are_rejected(server):
    """json.loads(bytes) would decode UTF-8-encoded surrogates (b"\\xed\\xa0\\x80") with surrogatepass: the body
    is decoded strictly first."""
    for raw in (b'{"model": "tiny", "prompt": "a\xed\xa0\x80b", "max_tokens": 2}',
                b'{"model": "tiny", "prompt": "\xff", "max_tokens": 2}'):
        err = _openai_error(_post(server, COMPLETIONS, raw=raw), 400)
        assert err["code"] == "invalid_json" and "UTF-8" in err["message"]
    _alive(server)


def test_surrogate_pairs_are_text(server):
    """An escaped surrogate pair is one character, accepted."""
    resp = _post(server, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi \U0001F600"}],
                                "max_tokens": 2})  # sent as the pair \ud83d\ude00
    assert resp.status_code == 200, resp.text


def test_deep_nesting_is_rejected(server):
    """Bodies nested past MAX_JSON_DEPTH are a 400, in any field and in a tool schema."""
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    _openai_error(_post(server, COMPLETIONS, raw=deep), 400)
    # A tool schema 600 levels deep (once a RecursionError in rendering), written out: json.dumps would recurse too.
    schema = '{"a": ' * 600 + "1" + "}" * 600
    raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
           '"function": {"name": "f", "parameters": ' + schema + "}}]}").encode()
    err = _openai_error(_post(server, CHAT, raw=raw), 400)
    assert "nests deeper" in err["message"]
    _alive(server)


BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_with_a_bad_schema_is_a_400(server, stream):
    """A forced tool call whose schema cannot compile is a 400 before any stream starts (OpenAI and Anthropic)."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "tools": BAD_TOOL, "tool_choice": "required",
            "stream": stream}
    _openai_error(_post(server, CHAT, body), 400, "tools[0]")
    anthropic = {"model": "tiny", "max_tokens": 8, "messages": USER, "stream": stream,
                 "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}], "tool_choice": {"type": "any"}}
    resp = _post(server, "/v1/messages", anthropic)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    _alive(server)


def test_forcing_a_good_tool_beside_a_bad_one_is_served(server):
    """Only the forced function is in the grammar, so another tool's bad schema does not matter (as with auto)."""
    tools = [*BAD_TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "g"}}}
    resp = _post(server, CHAT, body)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"structured_outputs": {"regex": "[a-z]+"}}])
def test_forced_tool_call_and_an_answer_format_are_a_400(server, fmt):
    """A forced tool call and a response format cannot both constrain one output (vLLM refuses it too); the format
    was silently ignored before. With tool_choice auto the format applies to the answer, as before."""
    tools = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "tools": tools, **fmt}
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        err = _openai_error(_post(server, CHAT, {**body, "tool_choice": choice}), 400, next(iter(fmt)))
        assert "tool_choice" in err["message"]
    assert _post(server, CHAT, {**body, "tool_choice": "auto"}).status_code == 200


def test_response_format_and_structured_outputs_together_are_a_400(server):
    """The prompt would announce one format while the sampler enforced the other."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "[a-z]+"}}
    assert "not both" in _openai_error(_post(server, CHAT, body), 400, "structured_outputs")["message"]


def test_union_type_errors_name_the_nested_field(server):
    """A wrong type inside a value that may be a string or a list of blocks names the block's field, not the
    'should be a valid string' of the union's first member."""
    messages = [{"role": "user", "content": "call f"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": [1, 2]}]}]
    resp = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": messages})
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert message == "messages.1.content.0.input: Input should be a valid dictionary"  # the str member: same field
    bad_part = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    err = _openai_error(_post(server, CHAT, {"model": "tiny", "messages": bad_part}), 422, "messages.0.content.0.text")
    assert "valid string" in err["message"]


def test_unknown_routes_and_methods_get_error_bodies(server):
    """404 and 405 answers carry OpenAI- or Anthropic-shaped error bodies."""
    resp = httpx.get(f"{server.url}{COMPLETIONS}", headers=server.headers())
    assert _openai_error(resp, 405)["type"] == "invalid_request_error"
    _openai_error(_post(server, "/v1/nope", {}), 404)
    resp = _post(server, "/v1/messages/batches", {})
    assert resp.status_code == 404 and resp.json()["type"] == "error", resp.text


def test_requests_that_can_never_fit_are_400_not_503(tiny_dir, tmp_path):
    """On a server with a 256-token KV cache and room for 3 sequences: a request whose KV cannot fit, streaming or
    not, and a request for more sequences than the server ever holds, are 400 (not 503 'retry later', and not a
    200 stream carrying the error); without max_tokens a request generates until the cache is full."""
    small = start_server(tiny_dir("base"), tmp_path, "--num-blocks", "16", "--max-num-seqs", "2",
                         "--max-queued-requests", "1", "--max-n", "8")
    try:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": [7] * 200, "max_tokens": 100, "stream": stream}
            err = _openai_error(_post(small, COMPLETIONS, body), 400, "max_tokens")
            assert "KV cache" in err["message"]
        _openai_error(_post(small, COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 4}), 400, "n")
        # Without max_tokens the default stops where the cache is full (the context would allow far more).
        free = _post(small, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * 50}],
                                   "ignore_eos": True})
        usage = free.json()["usage"]
        assert usage["completion_tokens"] == 256 + 1 - usage["prompt_tokens"], free.text
        _openai_error(_post(small, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * 150}]}),
                      400, "messages")
        ok = _post(small, COMPLETIONS, {"model": "tiny", "prompt": [7] * 200, "max_tokens": 50})
        assert ok.status_code == 200, ok.text
    finally:
        stop_server(small)
