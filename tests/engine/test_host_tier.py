"""The host tier on the tiny real models: a multi-turn session whose cache other traffic evicted from the device
comes back from host memory (`cached_tokens` > 0, host-tier hits counted) with outputs identical to no caching, for
prompts ending on and off a block boundary, on Kimi Linear and on Kimi K3."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A device cache of 40 blocks (640 tokens) and 2 checkpoint slots: the fillers push a session out of it.
SMALL = dict(block_size=16, state_checkpoint_interval=32, max_num_batched_tokens=256, num_blocks=40,
             num_checkpoint_slots=2)


def conversation(llm: LLM, first: list[int]) -> list:
    """Two sessions' turn 1, fillers that evict them from the device, then both sessions' turn 2 (extending prompt +
    answer), one request at a time."""
    results, history = [], []
    for s, prompt in enumerate([first, first[::-1][:101]]):
        results.append(r := llm.generate([prompt], GREEDY)[0])
        history.append(prompt + list(r.outputs[0].token_ids) + prompt_ids(600, 7 + s, seed=50 + s))
    for k in range(4):
        results.append(llm.generate([prompt_ids(600, 150 + 5 * k, seed=60 + k)], GREEDY)[0])
    for prompt in history:
        results.append(llm.generate([prompt], GREEDY)[0])
    return results


@pytest.mark.parametrize(("variant", "tp"), [("base", 1), ("k3", 1),
                                             pytest.param("base", 2, marks=pytest.mark.slow)])  # CI time
def test_session_evicted_from_the_device_comes_back_from_host_memory(tiny_dir, variant, tp):
    """tp=2: each worker rank keeps its own host copies (its heads' states), the scheduler's copies reach both."""
    path = str(tiny_dir(variant))
    first = prompt_ids(600, 96, seed=5)  # 96 tokens: ends on a block boundary; the second session's 101 does not
    off = conversation(LLM(model=path, enable_prefix_caching=False, **SMALL), first)
    device_only = LLM(model=path, **SMALL)
    tiered = LLM(model=path, host_cache_memory="16MiB", tensor_parallel_size=tp, **SMALL)
    on = conversation(tiered, first)
    plain = conversation(device_only, first)
    ids = [[r.outputs[0].token_ids for r in rs] for rs in (off, on, plain)]
    assert ids[0] == ids[1] == ids[2]
    # The follow-ups: the device-only cache lost them, the host tier served them.
    assert [r.num_cached_tokens for r in plain[-2:]] == [0, 0]
    assert all(r.num_cached_tokens >= 96 for r in on[-2:])
    stats = tiered.engine.cache.prefix_stats()
    assert stats.host_hit_tokens >= sum(r.num_cached_tokens for r in on[-2:])
    assert stats.host_blocks_demoted > 0 and stats.host_checkpoints_promoted >= 2
    if tp == 1:
        assert tiered.engine.executor.worker.runner.host.bytes_in > 0
    engine_stats = tiered.engine.get_stats()
    assert engine_stats.host_hit_tokens == stats.host_hit_tokens
    assert engine_stats.host_promoted_bytes > 0 and engine_stats.host_demoted_bytes > 0


def test_copies_beside_the_forward_equal_copies_before_it(tiny_dir, monkeypatch):
    """The host tier's copies overlapped with the forward layer by layer (`DELTASERVE_HOST_COPY_OVERLAP=1`: a copy
    thread here, a copy stream on a GPU) and all done before it (`0`, the CPU default): the same tokens and hits."""
    path, first = str(tiny_dir("base")), prompt_ids(600, 96, seed=5)
    runs = []
    for overlap in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_HOST_COPY_OVERLAP", overlap)
        llm = LLM(model=path, host_cache_memory="16MiB", **SMALL)
        assert llm.engine.executor.worker.runner.host.overlap is (overlap == "1")
        runs.append([(r.outputs[0].token_ids, r.num_cached_tokens) for r in conversation(llm, first)])
    assert runs[0] == runs[1] and all(cached >= 96 for _, cached in runs[0][-2:])


def test_host_tier_sizes_and_vllm_alias():
    from deltaserve.config import CacheConfig

    assert CacheConfig(kv_offloading_size=0.5).host_cache_memory == "0.5GiB"
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(kv_offloading_size=1.0, host_cache_memory="1GiB")
    with pytest.raises(ValueError, match="host_cache_memory"):
        CacheConfig(host_cache_memory="lots")


def test_too_small_host_tier_is_a_one_line_error(tiny_dir):
    with pytest.raises(ValueError, match="host_cache_memory='1KiB' holds 0 KV block"):
        LLM(model=str(tiny_dir("base")), host_cache_memory="1KiB")
