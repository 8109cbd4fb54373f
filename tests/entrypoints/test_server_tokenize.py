"""vLLM's /tokenize and /detokenize and Anthropic's /v1/messages/count_tokens on a live server: the counts are the
prompts the generation routes build (checked against their usage), and bad input is a 4xx."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from deltaserve.text.tokenizer import Tokenizer
from tests.entrypoints.server_fixture import API_KEY
from tests.entrypoints.test_server_anthropic import TOOLS
from tests.entrypoints.test_server_errors import _openai_error, _post

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    return Tokenizer.from_pretrained(server.model_dir)


def test_tokenize_text_and_detokenize(server, tokenizer):
    """A text prompt gives the tokenizer's ids (and token strings when asked); /detokenize inverts it."""
    text = "The scheduler decides which requests run"
    res = _post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert res["tokens"] == tokenizer.encode(text) and res["count"] == len(res["tokens"])
    assert res["max_model_len"] == 2048 and "".join(res["token_strs"]).replace("Ġ", " ") == text
    assert _post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None  # model is optional
    assert _post(server, "/detokenize", {"model": "tiny", "tokens": res["tokens"]}).json() == {"prompt": text}
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_chat_is_the_chat_prompt(server):
    """With messages (and tools), /tokenize counts exactly the prompt tokens /v1/chat/completions reports; without
    the generation prompt it is shorter."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    usage = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=OPENAI_TOOLS, max_tokens=1).usage
    body = {"model": "tiny", "messages": MESSAGES, "tools": OPENAI_TOOLS}
    res = _post(server, "/tokenize", body).json()
    assert res["count"] == usage.prompt_tokens == len(res["tokens"])
    assert _post(server, "/tokenize", {**body, "add_generation_prompt": False}).json()["count"] < res["count"]
    # truncate_prompt_tokens as chat completions applies it (-1: up to max_model_len; 0 is refused)
    cut = _post(server, "/tokenize", {**body, "truncate_prompt_tokens": 5}).json()
    assert cut["tokens"] == res["tokens"][-5:]
    assert _post(server, "/tokenize", {**body, "truncate_prompt_tokens": -1}).json()["count"] == res["count"]
    _openai_error(_post(server, "/tokenize", {**body, "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")


def test_count_tokens_with_the_anthropic_sdk(server):
    """messages.count_tokens gives the input_tokens that messages.create reports for the same request."""
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    request = {"model": "tiny", "system": "Be brief.", "tools": TOOLS,
               "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    counted = client.messages.count_tokens(**request)
    assert counted.input_tokens == client.messages.create(max_tokens=1, **request).usage.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(**{**request, "model": "other"})


def test_tokenize_errors_are_4xx(server):
    """Out-of-vocabulary ids, a body with neither prompt nor messages, another model, a bad tool_choice."""
    _openai_error(_post(server, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    _openai_error(_post(server, "/detokenize", {"tokens": "abc"}), 422)
    _openai_error(_post(server, "/tokenize", {"model": "tiny"}), 422, "prompt")
    _openai_error(_post(server, "/tokenize", {"prompt": 123}), 422, "prompt")  # a text body's own field is named
    _openai_error(_post(server, "/tokenize", {"prompt": "hi", "return_token_strs": "x"}), 422, "return_token_strs")
    _openai_error(_post(server, "/tokenize", {"model": "other", "prompt": "x"}), 404)
    _openai_error(_post(server, "/tokenize", {"messages": MESSAGES, "tool_choice": "required"}), 400, "tool_choice")
    resp = _post(server, "/v1/messages/count_tokens", {"model": "tiny", "messages": []})
    assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
    assert httpx.get(f"{server.url}/tokenize").status_code == 405


def test_prefill_continues_the_assistant_message(server):
    """vLLM's continue_final_message (OpenAI) and a last assistant message (Anthropic, with the SDK) continue that
    message: the greedy answer is what /v1/completions gives for the rendered prompt ids, and both APIs agree."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    body = {"model": "tiny", "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    ids = _post(server, "/tokenize", body).json()["tokens"]
    plain = _post(server, "/tokenize", {"model": "tiny", "messages": messages[:1]}).json()["tokens"]
    assert ids[:len(plain)] == plain and len(ids) > len(plain)  # the generation prompt, then the prefix's tokens
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = _post(server, "/v1/chat/completions", {**body, **greedy}).json()
    text = _post(server, "/v1/completions", {"model": "tiny", "prompt": ids, **greedy}).json()["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == text and chat["usage"]["prompt_tokens"] == len(ids)
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    msg = client.messages.create(model="tiny", max_tokens=6, messages=messages, extra_body={"temperature": 0})
    until_eos = _post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 6,
                                                  "temperature": 0}).json()["choices"][0]["text"]
    assert msg.usage.input_tokens == len(ids)
    assert "".join(b.text for b in msg.content if b.type == "text") == until_eos
    for extra, needle in (({"add_generation_prompt": True}, "cannot both"),
                          ({"chat_template_kwargs": {"thinking": True}}, "thinking mode"),
                          ({"response_format": {"type": "json_object"}}, "response format")):
        err = _openai_error(_post(server, "/v1/chat/completions", {**body, **extra}), 400, "continue_final_message")
        assert needle in err["message"]


def test_echo_logprobs_score_the_prompt(server):
    """What lm-evaluation-harness sends to score a continuation (echo, logprobs, max_tokens 1, temperature 0): every
    prompt token comes back, the first with a None logprob, then the generated one; the prompt values equal vLLM's
    prompt_logprobs field, streamed or not, on completions and chat."""
    text = "The scheduler decides which requests run next."
    ids = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    body = {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    field = _post(server, "/v1/completions", {**body, "echo": False, "prompt_logprobs": 0}).json()["choices"][0]
    scored = field["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert [scored[k][str(ids[k])]["logprob"] for k in range(1, len(ids))] == lp["token_logprobs"][1:len(ids)]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      headers=server.headers(), timeout=60) as resp:
        streamed = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    tokens = [t for e in streamed for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == lp["tokens"]
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                 "prompt_logprobs": 2}
    chat = _post(server, "/v1/chat/completions", chat_body).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]  # vLLM: beside the choices
    _openai_error(_post(server, "/v1/chat/completions", {**chat_body, "stream": True}), 400, "prompt_logprobs")
    # several prompts in one request (lm-eval batches): each choice scores its own prompt (they were lost)
    two = _post(server, "/v1/completions", {**body, "prompt": [ids, ids[:3]]}).json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in two] == [len(ids) + 1, 3 + 1]
    assert two[0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)  # batched numerics
    one = _post(server, "/v1/completions", {**body, "prompt": ids[:1], "prompt_logprobs": 0}).json()["choices"][0]
    assert one["prompt_logprobs"] == [None] and one["logprobs"]["token_logprobs"][0] is None


def test_echo_text_offsets_follow_the_text(server):
    """Text offsets of an echoed prompt are the lengths of its decoded prefixes, also when a character's UTF-8 bytes
    are split over tokens (each token counted alone, they drifted by one per split character)."""
    text = "wörld ñandú ü 😀 日本"
    ids = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    body = {"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True,
            "ignore_eos": True}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    prefixes = [len(_post(server, "/detokenize", {"tokens": ids[:k]}).json()["prompt"]) for k in range(len(ids))]
    assert offsets[:len(ids)] == prefixes and len(ids) > len(text) / 2  # several multi-byte splits in this vocab
    assert offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
