"""`NgramProposer`: vLLM's prompt lookup (longest n-gram first, its earliest occurrence, up to k tokens after it),
checked on hand-made contexts and against a brute-force search on random small-vocabulary contexts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode.ngram import NgramProposer, propose_ngram


def lookup(context: list[int], lo: int, hi: int, k: int) -> list[int]:
    return propose_ngram(np.array(context, dtype=np.int64), lo, hi, k)


def brute_force(context: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The definition: for n from hi down to lo, the first start s (s + n < len) with context[s:s+n] equal to the
    last n tokens; the k tokens after it."""
    for n in range(hi, lo - 1, -1):
        suffix = context[len(context) - n:]
        for s in range(len(context) - n):
            if context[s:s + n] == suffix:
                return context[s + n:s + n + k]
    return []


def request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), output_token_ids=list(output),
                   params=SamplingParams(max_tokens=100), stop_token_ids=frozenset(), arrival_index=0, priority=0,
                   max_total_tokens=10_000)


def test_vllm_docstring_example():
    """vLLM's example: [1,2,3,4,2,3], n in 2..3, k=4: [4,2,3] has no earlier match, [2,3] does; only 3 tokens
    follow it (the proposal runs into the suffix and stops at the end)."""
    assert lookup([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_ngram_wins_over_a_later_shorter_one():
    # [7, 8] occurs at 0 (followed by 1) and [9, 7, 8] at 4 (followed by 5): the 3-gram's continuation is taken.
    context = [7, 8, 1, 1, 9, 7, 8, 5, 6, 9, 7, 8]
    assert lookup(context, 1, 3, 2) == [5, 6]
    assert lookup(context, 1, 2, 2) == [1, 1]  # capped at 2: the earliest [7, 8]


def test_earliest_occurrence_of_the_same_length():
    context = [4, 10, 4, 20, 4, 30, 4]
    assert lookup(context, 1, 1, 1) == [10]


def test_k_caps_the_proposal():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert lookup(context, 2, 2, 3) == [3, 4, 5]
    assert lookup(context, 2, 2, 10) == [3, 4, 5, 6, 7, 8, 1, 2]  # up to the end of the context


def test_min_n_is_enforced():
    context = [1, 2, 3, 9, 2, 3]
    assert lookup(context, 2, 4, 2) == [9, 2]
    assert lookup(context, 3, 4, 2) == []  # only a 2-gram recurs


@pytest.mark.parametrize("context", [[], [5], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_no_match(context):
    assert lookup(context, 1, 3, 4) == []


def test_a_repeated_token_matches_itself_shifted():
    assert lookup([3, 3, 3, 3], 1, 3, 5) == [3]  # [3,3,3] at 0 is followed by the last 3


def test_matches_brute_force_on_random_contexts():
    rng = random.Random(0)
    for _ in range(3000):
        context = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(1, 5)
        assert lookup(context, lo, hi, k) == brute_force(context, lo, hi, k), (context, lo, hi, k)


def test_proposer_looks_up_prompt_and_output():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert (proposer.num_speculative_tokens, proposer.memory_bytes) == (3, 0)
    a = request("a", [10, 11, 12, 13, 14, 15], [10, 11])  # matches across prompt and output
    b = request("b", [1, 2, 3])  # nothing recurs: no proposal
    c = request("c", [5, 6], [7, 5, 6])
    out = proposer.propose([a, b, c])
    assert {rid: p.token_ids for rid, p in out.items()} == {"a": [12, 13, 14], "c": [7, 5, 6]}
    assert all(p.probs is None for p in out.values())
    a.output_token_ids.append(99)  # the next step sees the new output token (the prompt array is reused)
    assert proposer.propose([a]) == {}
    proposer.forget("a")
    proposer.forget("unknown")
    again = request("a", [8, 9, 8])  # a forgotten id's prompt is read afresh
    assert {rid: p.token_ids for rid, p in proposer.propose([again]).items()} == {"a": [9, 8]}


@pytest.mark.parametrize("lo, hi, k", [(0, 3, 2), (4, 3, 2), (1, 3, 0)])
def test_bad_bounds(lo, hi, k):
    with pytest.raises(ValueError):
        NgramProposer(k, lo, hi)
