"""Speculative decoding with every other feature, end to end through `LLM` on the embedded (trained) model, whose
greedy output continues a repetitive prompt, so n-gram proposals are accepted: structured output (a JSON schema, a
forced tool call), stop strings and stop ids inside an accepted run, `max_tokens`, `n` > 1 with logprobs, and
streaming several tokens per chunk through the real server."""

from __future__ import annotations

import json

import openai
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.default_model import default_model_dir
from deltaserve.sampling_params import StructuredOutput
from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server

PROMPT = "import os\n" * 4  # continued by more of the same: most proposals are accepted
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def llms():
    return LLM(max_num_seqs=8), LLM(max_num_seqs=8, speculative_config=NGRAM)


def accepted(llm: LLM) -> int:
    return llm.engine.get_stats().spec_num_accepted_tokens


def both(llms, prompts, params):
    """Plain and speculative outputs of the same prompts, and the tokens the speculative run accepted."""
    plain, spec = llms
    before = accepted(spec)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    return a, b, accepted(spec) - before


def test_json_schema_requests_stay_valid_and_equal_plain(llms):
    """The grammar advances over accepted tokens only: proposals it refuses are cut, each verified position gets the
    grammar's mask after the proposals before it."""
    data = {"name": "red", "color": "green", "shade": "blue"}
    prompt = "Data: " + " ".join([json.dumps(data)] * 4) + " Data: "
    colours = {"type": "string", "enum": ["red", "green", "blue"]}  # short values: the text must end
    schema = {"type": "object", "properties": dict.fromkeys(data, colours), "required": list(data),
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=200,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    a, b, gained = both(llms, [prompt], params)
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids
    assert b[0].outputs[0].finish_reason == "stop", b[0].outputs[0].text
    parsed = json.loads(b[0].outputs[0].text)
    assert set(parsed) == set(data) and set(parsed.values()) <= {"red", "green", "blue"}
    assert gained > 0  # the constrained request really verified proposals


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 11])
def test_max_tokens_is_never_exceeded(llms, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    a, b, _ = both(llms, [PROMPT], params)
    out = b[0].outputs[0]
    assert out.token_ids == a[0].outputs[0].token_ids and len(out.token_ids) == max_tokens
    assert len(out.logprobs) == max_tokens


def test_stop_string_and_stop_id_inside_an_accepted_run(llms):
    """Nothing after the stop is returned, though the verification accepted tokens past it."""
    plain, _ = llms
    free = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[2]  # "\n": the first step sampled "import", the second accepts " os", "\n", ...
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=["os\nimport os"]),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id], logprobs=1)]
    a, b, gained = both(llms, [PROMPT, PROMPT], params)
    assert gained > 0
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].text == x.outputs[0].text and y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].finish_reason == "stop"
    assert b[0].outputs[0].text == "import "
    ids = b[1].outputs[0].token_ids
    assert ids[-1] == stop_id and stop_id not in ids[:-1]
    assert len(b[1].outputs[0].logprobs) == len(ids)


def test_n_samples_with_logprobs_equal_plain(llms):
    """n > 1 fans out into seeded children: each verifies its own proposals; every returned token has logprobs."""
    params = SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    a, b, gained = both(llms, [PROMPT], params)
    assert gained > 0
    for x, y in zip(a[0].outputs, b[0].outputs, strict=True):
        assert y.token_ids == x.token_ids
        assert len(y.logprobs) == len(y.token_ids) == 12
        for lp, token in zip(y.logprobs, y.token_ids, strict=True):
            assert lp is not None and lp.token_id == token and len(lp.top) == 2


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    live = start_server(default_model_dir(), tmp_path_factory.mktemp("spec-stream"), "--max-model-len", "1024",
                        "--speculative-config", json.dumps(NGRAM))
    yield live
    stop_server(live)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


def test_forced_tool_call_stays_valid(spec_server):
    """A forced tool call is a grammar too: the call parses and names the tool. The prompt holds the arguments'
    text, so n-gram proposals continue `{"` with `city": "Paris"}`, which the grammar admits and the step verifies
    (proposals copied from the tool declaration, `type": "object"`, are cut by the grammar)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    before = spec_server.metric("spec_decode_num_drafts_total")
    resp = client(spec_server).chat.completions.create(
        model=spec_server.model, max_tokens=64, temperature=0, tools=[tool],
        messages=[{"role": "user", "content": 'get_weather {"city": "Paris"} get_weather {"city": "Paris"}'}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = resp.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    assert spec_server.metric("spec_decode_num_drafts_total") > before


def test_streaming_carries_several_tokens_per_chunk(spec_server):
    stream = client(spec_server).completions.create(model=spec_server.model, prompt=PROMPT, max_tokens=24,
                                                    temperature=0, stream=True, logprobs=0,
                                                    extra_body={"ignore_eos": True})
    per_chunk = [len(chunk.choices[0].logprobs.tokens) for chunk in stream
                 if chunk.choices and chunk.choices[0].logprobs is not None]
    assert sum(per_chunk) == 24
    assert max(per_chunk) > 1  # accepted proposals arrive together
