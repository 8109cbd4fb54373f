"""Prefix caching on the tiny real model: outputs identical with caching on and off, hits where they should be."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, state_checkpoint_interval=32, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def path(tiny_dir):
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def off(path):
    return LLM(model=path, enable_prefix_caching=False, **ENGINE)


def ids_of(results):
    return [r.outputs[0].token_ids for r in results]


def run_sequentially(llm, prompts):
    return [llm.generate([p], GREEDY)[0] for p in prompts]


def test_shared_long_prefixes(path, off):
    """Prompts sharing a 150-token prefix, run one after another: same outputs, later ones hit the cache."""
    base = prompt_ids(1024, 150, seed=1)
    prompts = [base + prompt_ids(1024, 10 + 7 * i, seed=20 + i) for i in range(4)]
    on = LLM(model=path, **ENGINE)
    got = run_sequentially(on, prompts)
    assert ids_of(got) == ids_of(run_sequentially(off, prompts))
    assert got[0].num_cached_tokens == 0
    # The first prompt (160 tokens) checkpointed its last full block, 144: the deepest point inside the share.
    assert all(r.num_cached_tokens == 144 for r in got[1:])
    stats = on.engine.cache.prefix_stats()
    assert stats.hit_tokens == 3 * 144 and stats.queried_tokens == sum(len(p) for p in prompts)


def test_multi_turn_chat_hits_the_end_of_the_previous_turn(path, off):
    """Each turn extends the previous prompt and answer: it hits at the exact end of the previous turn."""
    on = LLM(model=path, **ENGINE)
    history_on, history_off = prompt_ids(1024, 37, seed=3), prompt_ids(1024, 37, seed=3)
    previous_len = 0
    for turn in range(4):
        a = on.generate([history_on], GREEDY)[0]
        b = off.generate([history_off], GREEDY)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"turn {turn}"
        if turn:
            # The previous turn computed everything but its last sampled token.
            assert a.num_cached_tokens == previous_len - 1, (turn, a.num_cached_tokens)
        previous_len = len(history_on) + len(a.outputs[0].token_ids)
        user = prompt_ids(1024, 5 + turn, seed=40 + turn)
        history_on = history_on + a.outputs[0].token_ids + user
        history_off = history_off + b.outputs[0].token_ids + user


@pytest.mark.parametrize("shared, expected_hit", [(64, 64), (65, 64), (63, 32), (96, 96), (20, 0)],
                         ids=["on-boundary", "one-past", "one-short", "interval", "below-first"])
def test_prefix_ending_on_and_off_block_boundaries(path, off, shared, expected_hit):
    """A second prompt sharing exactly / just off a block boundary hits the deepest checkpoint inside the share."""
    first = prompt_ids(1024, 120, seed=5)
    second = first[:shared] + prompt_ids(1024, 30, seed=6)
    on = LLM(model=path, **ENGINE)
    on.generate([first], GREEDY)
    got = on.generate([second], GREEDY)[0]
    assert got.num_cached_tokens == expected_hit
    assert got.outputs[0].token_ids == off.generate([second], GREEDY)[0].outputs[0].token_ids


def test_concurrent_requests_share_the_prefix_work(path, off):
    """Four requests with one 256-token prefix arriving together: same outputs, and the prefix is computed once."""
    base = prompt_ids(1024, 256, seed=7)
    prompts = [base + prompt_ids(1024, 12, seed=70 + i) for i in range(4)]
    on = LLM(model=path, **ENGINE)
    got = on.generate(prompts, GREEDY)
    assert ids_of(got) == ids_of(off.generate(prompts, GREEDY))
    assert sorted(r.num_cached_tokens for r in got) == [0, 256, 256, 256]


def test_small_cache_evicts_and_outputs_stay_identical(path, off):
    """With 2 checkpoint slots and a small block pool, eviction happens and outputs do not change."""
    prompts = []
    for i, b in enumerate([0, 0, 1, 1, 2, 2, 0]):  # pairs hit each other; base 0 comes back after eviction
        prompts.append(prompt_ids(1024, 64, seed=100 + b) + prompt_ids(1024, 9, seed=200 + i))
    on = LLM(model=path, num_checkpoint_slots=2, num_blocks=12, **ENGINE)
    got = run_sequentially(on, prompts)
    assert ids_of(got) == ids_of(run_sequentially(off, prompts))
    stats = on.engine.cache.prefix_stats()
    assert stats.checkpoint_evictions > 0 and stats.block_evictions > 0 and stats.hit_tokens > 0
    assert got[-1].num_cached_tokens < got[1].num_cached_tokens  # base 0's checkpoints were evicted meanwhile
    usage = on.engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_preemption_with_caching_resumes_from_checkpoints(path, tiny_dir):
    """Under heavy preemption with caching on, outputs equal a roomy run and resumed requests hit their state."""
    prompts = [prompt_ids(1024, n, seed=300 + n) for n in (40, 70, 90, 33, 120, 64)]
    roomy = LLM(model=path, enable_prefix_caching=False)
    expected = ids_of(roomy.generate(prompts, GREEDY))
    tight = LLM(model=path, num_blocks=14, num_state_slots=3, max_num_batched_tokens=64, block_size=16,
                state_checkpoint_interval=32)
    assert ids_of(tight.generate(prompts, GREEDY)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.cache.prefix_stats().hit_tokens > 0
    usage = tight.engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots
