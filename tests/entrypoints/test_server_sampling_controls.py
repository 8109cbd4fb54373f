"""OpenAI's logit_bias and vLLM's allowed_token_ids and guided choice through the official `openai` SDK against a
live server, and their bad values as 400s naming the field."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server
from tests.entrypoints.test_server_errors import USER, _openai_error, _post

PROMPT = [5, 9, 33, 7]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _ids(server, path: str, body: dict) -> list[int]:
    """The sampled token ids, from logprobs with vLLM's return_tokens_as_token_ids."""
    resp = _post(server, path, {"model": "tiny", "ignore_eos": True, "return_tokens_as_token_ids": True, **body})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    tokens = choice["logprobs"]["tokens"] if "tokens" in choice["logprobs"] else [
        e["token"] for e in choice["logprobs"]["content"]]
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_logit_bias_bans_and_forces_tokens(server, client):
    """-100 on the greedy first token changes it; +100 on a token makes greedy decoding emit it at every step,
    on completions and chat (the SDK's own logit_bias argument)."""
    greedy = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    first = _ids(server, "/v1/completions", greedy)
    banned = _ids(server, "/v1/completions", {**greedy, "logit_bias": {str(first[0]): -100}})
    assert len(first) == len(banned) == 4 and banned[0] != first[0]
    forced = _ids(server, "/v1/completions", {**greedy, "logit_bias": {"77": 100}})
    chat = _ids(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0,
                                                  "logprobs": True, "logit_bias": {"77": 100}})
    assert forced == [77] * 4 and chat == [77] * 3
    sdk = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, temperature=0,
                                         logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert sdk.choices[0].message.content == _text_of(server, [77, 77])


def test_bad_words_are_never_completed(server):
    """vLLM's bad_words: the greedy first word, banned, is not generated again anywhere in the output."""
    greedy = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    first = _ids(server, "/v1/completions", greedy)
    word = _text_of(server, first[:1]).strip()
    assert word
    banned = _ids(server, "/v1/completions", {**greedy, "bad_words": [word]})
    assert len(banned) == 8 and first[0] not in banned and banned != first


def _text_of(server, ids: list[int]) -> str:
    return _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_allowed_token_ids_and_guided_choice(server, client):
    """allowed_token_ids confine sampled tokens; structured_outputs.choice (and guided_choice) give one of the
    strings exactly."""
    ids = _ids(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3,
                                           "allowed_token_ids": [300, 301, 302], "logprobs": 0})
    assert len(ids) == 8 and set(ids) <= {300, 301, 302}
    choices = ["red", "green", 'a "quoted" choice']
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        for seed in range(3):
            answer = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=1.0,
                                                    seed=seed, extra_body=extra).choices[0].message.content
            assert answer in choices


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),  # str.isdigit() is True for it: once a 500
    ({"logit_bias": {"1024": 1}}, "logit_bias"),  # the tiny vocabulary has 1024 tokens
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": [5, 4096]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
])
def test_bad_sampling_controls_are_400(server, extra, param):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
    _openai_error(_post(server, "/v1/completions", body), 400, param)


@pytest.mark.slow  # CI time: the scheduler's priority tests stay in CI
def test_priority_orders_the_queue_on_a_priority_server(tiny_dir, tmp_path, server):
    """vLLM's request priority: with --policy priority and room for one sequence, a request sent later with a lower
    priority value finishes before an earlier one; on a first-come server a non-zero priority is a 400."""
    _openai_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "priority": 1}), 400, "priority")
    live = start_server(tiny_dir("base"), tmp_path, "--policy", "priority", "--max-num-seqs", "1")
    try:
        done: list[str] = []

        def send(name: str, priority: int, tokens: int) -> None:
            resp = _post(live, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens,
                                                   "ignore_eos": True, "priority": priority})
            assert resp.status_code == 200, resp.text
            done.append(name)

        with ThreadPoolExecutor(3) as pool:
            blocker = pool.submit(send, "blocker", 0, 800)  # seconds of decoding on any CPU
            time.sleep(0.5)  # the blocker holds the only sequence slot
            late_low = pool.submit(send, "low", 5, 4)
            time.sleep(0.2)
            high = pool.submit(send, "high", -1, 4)
            for f in (blocker, late_low, high):
                f.result()
        assert done == ["blocker", "high", "low"]
    finally:
        stop_server(live)


def test_choice_lists_beyond_llguidance_row_limit_and_control_characters(client):
    """5,000 choices sharing a prefix (as parser rules llguidance failed at the shared prefix, mid-generation) and
    choices with DEL / C1 / line-separator characters (a Lark lexer error) give an exact choice."""
    many = [f"choice_{i}" for i in range(5000)]
    for extra, allowed in (({"guided_choice": many}, many), ({"structured_outputs": {"choice": ["\x7f", "a\x85b"]}},
                                                             ["\x7f", "a\x85b"])):
        answer = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=1.0, seed=1,
                                                extra_body=extra).choices[0].message.content
        assert answer in allowed
