"""`LLM(data_parallel_size=2)`: two engine processes behind the router, the greedy outputs of one engine."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine import dp_client
from deltaserve.executor import worker

PROMPTS = [f"Prompt {i}: a {'short' if i % 3 else 'longer'} sentence about caches and" for i in range(10)]


def test_llm_data_parallel_gives_the_greedy_outputs_of_one_engine(tiny_dir, monkeypatch: pytest.MonkeyPatch):
    # One torch thread per engine in both runs (GEMM rounding depends on the thread count): a DP=2 replica gets
    # half the cores, the single in-process engine all of them.
    monkeypatch.setattr(dp_client, "default_num_threads", lambda: 2)
    monkeypatch.setattr(worker, "default_num_threads", lambda: 1)
    path = str(tiny_dir("base"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=path, max_model_len=768, data_parallel_size=2)
    try:
        assert isinstance(llm.client, dp_client.DPEngineClient) and len(llm.client.replicas) == 2
        with pytest.raises(AttributeError, match="data_parallel_size"):
            _ = llm.engine
        out = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS[:2], params)  # the engine processes live on between calls
        routed = list(llm.client.routed)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[10**6]], params)
    finally:
        llm.shutdown()
    assert not llm.client.is_alive
    assert all(n > 0 for n in routed) and sum(routed) == len(PROMPTS) + 2
    ref = LLM(model=path, max_model_len=768).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref[:2]]


@pytest.mark.slow  # CI time: DP and TP each stay in CI
def test_llm_data_parallel_replicas_can_be_tensor_parallel(tiny_dir, monkeypatch: pytest.MonkeyPatch):
    """DP=2 x TP=2 (two engine processes, each with two gloo worker ranks) gives the greedy outputs of one TP=2
    engine."""
    # Each rank gets the threads of a rank of the reference TP=2 engine (whose worker processes use the default).
    cores = dp_client.default_num_threads()
    monkeypatch.setattr(dp_client, "default_num_threads", lambda: 2 * cores)
    path = str(tiny_dir("base"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=path, max_model_len=512, data_parallel_size=2, tensor_parallel_size=2)
    try:
        out = llm.generate(PROMPTS[:6], params)
        routed = list(llm.client.routed)
    finally:
        llm.shutdown()
    assert sum(routed) == 6 and min(routed) > 0
    ref = LLM(model=path, max_model_len=512, tensor_parallel_size=2).generate(PROMPTS[:6], params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
