"""End to end: the official `openai` SDK against a live `deltaserve serve` on a tiny random checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from deltaserve.entrypoints.llm import LLM
from deltaserve.sampling_params import SamplingParams
from tests.entrypoints.server_fixture import API_KEY

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                      "parameters": {"type": "object", "properties": {
                                                         "city": {"type": "string", "enum": ["Oslo", "Rome"]}},
                                                     "required": ["city"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    root = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()["data"][0]["root"]
    assert root == str(server.model_dir.resolve())  # vLLM's field: where a client on this host finds the tokenizer
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_matches_the_engine(server, client):
    """Greedy completions through HTTP are token-for-token the offline engine's output."""
    prompt = "The scheduler decides which requests run"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    llm = LLM(model=str(server.model_dir), max_model_len=768)
    ref = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))


def test_completion_stream_equals_non_stream_with_usage(client):
    kwargs = dict(model="tiny", prompt="Linear attention keeps a state", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[0].choices and chunks[0].choices[0].text  # the first chunk carries text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert not chunks[-1].choices


def test_completion_n_seed_and_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="Numbers such as", max_tokens=6, temperature=1.0,
                                     n=3, seed=7, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    for c in resp.choices:
        assert len(c.logprobs.tokens) == 6 and len(c.logprobs.token_logprobs) == 6
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    again = client.completions.create(model="tiny", prompt="Numbers such as", max_tokens=6, temperature=1.0,
                                      n=3, seed=7, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible
    assert resp.usage.completion_tokens == 18


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Say something about caches."}],
                  max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    msg = whole.choices[0].message
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (msg.content or "")
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and (first.content or first.tool_calls or first.model_extra)
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_n_and_logprobs(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, n=2, seed=3, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    assert len(resp.choices) == 2
    for c in resp.choices:
        assert len(c.logprobs.content) == 5
        assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in c.logprobs.content)


def test_chat_json_schema_validates(client):
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather plan as JSON."}],
                      max_tokens=120, temperature=0.8, seed=11,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "plan", "schema": WEATHER_SCHEMA}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), WEATHER_SCHEMA)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_api_process_does_not_load_torch(client, server):
    """The API process renders, tokenises, validates grammars and parses; only the engine process needs torch (a few
    hundred MB and a second or two of start-up less for the process that answers HTTP)."""
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Plan"}], max_tokens=8,
                                   tools=TOOLS, response_format={"type": "json_schema", "json_schema": {
                                       "name": "plan", "schema": WEATHER_SCHEMA}})
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
    if children.exists():  # the engine process does load it (the check above reads the right kind of file)
        assert any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in children.read_text().split())


def test_chat_json_object(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                          max_tokens=150, temperature=0, response_format={"type": "json_object"})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # a random model may still be inside a long string at max_tokens; the prefix must be a JSON object start
        assert resp.choices[0].message.content.lstrip().startswith("{")


def _check_calls(calls, name=None):
    assert calls, "no tool calls returned"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in PARAMS if name is None else call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice, parallel", [
    ("required", False), ("required", True), ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_tool_choice_forced(client, choice, parallel):
    """Forced calls are grammar-constrained: even a random model returns calls valid for the tool's schema."""
    name = None if choice == "required" else "get_time"
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=600, temperature=0.7,
                  seed=5)
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].finish_reason == "tool_calls"
    _check_calls(resp.choices[0].message.tool_calls, name)
    assert parallel or len(resp.choices[0].message.tool_calls) == 1
    # streaming: the SDK's accumulated tool calls are well formed too
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] = (d.function.name if d.function else None) or entry["name"]
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert calls and (parallel or len(calls) == 1)
    for entry in calls.values():
        assert entry["id"] and (entry["name"] in PARAMS if name is None else entry["name"] == name)
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])


def test_multi_turn_with_tool_results(client):
    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Lima for 3 days?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=150, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather in Lima for 3 days?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                            "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_thinking_on_reports_reasoning(client):
    base = dict(model="tiny", messages=[{"role": "user", "content": "Think first."}], max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    off = client.chat.completions.create(**base)
    on = client.chat.completions.create(**{**base, "extra_body": {"ignore_eos": True,
                                                                  "chat_template_kwargs": {"thinking": True}}})
    assert on.usage.prompt_tokens == off.usage.prompt_tokens + 1  # the generation prompt ends with <think>
    reasoning = on.choices[0].message.model_extra.get("reasoning_content")
    assert isinstance(reasoning, str)
    assert (reasoning or "") + (on.choices[0].message.content or "")  # the tokens went to a channel
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})


def test_regex_constraint_on_completions_and_chat(client):
    import re

    pattern = r"(yes|no), [0-9]{1,3}"
    comp = client.completions.create(model="tiny", prompt="Answer:", max_tokens=20, temperature=0.9, seed=1,
                                     extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, comp.choices[0].text) and comp.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yes or no?"}],
                                          max_tokens=20, temperature=0.9, seed=2,
                                          extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, chat.choices[0].message.content)


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (completion tokens
    never decrease, prompt tokens fixed); the last, choice-less chunk has the totals the non-streamed call reports."""
    kwargs = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "Count"}], **kwargs)
    chunks = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Count"}], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages) and len(chunks) >= 3
    assert {u.prompt_tokens for u in usages} == {plain.usage.prompt_tokens}
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == plain.usage.completion_tokens == 6
    assert chunks[-1].choices == []
    text = list(client.completions.create(model="tiny", prompt="Count", stream=True, max_tokens=4, temperature=0,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True},
                                          extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in text][-1] == 4 and all(c.usage is not None for c in text)
    # n = 2: each chunk counts its own choice (vLLM's per-choice counts); the last chunk has the total
    two = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Count"}], stream=True, n=2, seed=3,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in two[:-1]:
        per_choice[c.choices[0].index].append(c.usage.completion_tokens)
    assert all(v == sorted(v) and v[-1] == 6 for v in per_choice.values())
    assert two[-1].choices == [] and two[-1].usage.completion_tokens == 12


def test_truncate_prompt_tokens_and_include_reasoning(client):
    """vLLM's truncate_prompt_tokens keeps the last k prompt tokens (completions: the same output as sending them
    alone; chat: of the rendered prompt); include_reasoning=False drops reasoning_content, not the reasoning."""
    ids = list(range(40, 90))
    kwargs = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=ids, **{**kwargs, "extra_body": {"ignore_eos": True,
                                                                            "truncate_prompt_tokens": 8}})
    tail = client.completions.create(prompt=ids[-8:], **kwargs)
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == tail.choices[0].text
    messages = [{"role": "user", "content": "Tell me a long story about a scheduler."}]
    chat = client.chat.completions.create(messages=messages, **{**kwargs, "extra_body": {"truncate_prompt_tokens": 6}})
    assert chat.usage.prompt_tokens == 6
    thinking = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}
    shown = client.chat.completions.create(messages=messages, **{**kwargs, "extra_body": thinking})
    hidden = client.chat.completions.create(messages=messages,
                                            **{**kwargs, "extra_body": {**thinking, "include_reasoning": False}})
    assert shown.choices[0].message.reasoning_content is not None
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    # the same greedy generation: only what is shown differs
    assert hidden.choices[0].message.content == shown.choices[0].message.content
    assert hidden.usage.prompt_tokens == shown.usage.prompt_tokens


@pytest.mark.parametrize("echo, special", [(False, False), (True, False), (False, True)])
def test_streamed_completion_logprobs_equal_the_non_streamed(server, client, echo, special):
    """Streamed chunks carry every token's logprobs (also of tokens without text, such as a special token that is
    skipped: once dropped) with text offsets that continue across chunks: concatenated, they equal the
    non-streamed logprobs."""
    bias = {}
    if special:  # every other step <|im_end|>, which has no text with skip_special_tokens
        im_end = httpx.post(f"{server.url}/tokenize", json={"prompt": "<|im_end|>"},
                            headers=server.headers()).json()["tokens"]
        bias = {"logit_bias": {str(im_end[0]): 12}}
    kwargs = dict(model="tiny", prompt="The scheduler", max_tokens=12, temperature=0, logprobs=1, echo=echo,
                  extra_body={"ignore_eos": True, **bias})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    prompt_len = len(httpx.post(f"{server.url}/tokenize", json={"prompt": "The scheduler"},
                                headers=server.headers()).json()["tokens"]) if echo else 0
    assert tokens == whole.tokens and len(tokens) == prompt_len + 12  # echo: the prompt's tokens come first
    assert values == pytest.approx(whole.token_logprobs) and offsets == whole.text_offset
    assert (values[0] is None) == echo  # the first prompt token has no logprob
    if special:
        text = client.completions.create(**kwargs).choices[0].text
        assert len(text) < sum(len(t) for t in tokens)  # some tokens (the special ones) add no text
