"""The continuous-batching engine on a tiny real model: batched == alone == transformers, chunking, preemption."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from tests.helpers import hf_greedy, prompt_ids

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LENGTHS = [1, 2, 3, 5, 8, 13, 17, 31, 32, 33, 47, 64, 65, 90, 120, 150, 7, 11]


@pytest.fixture(scope="module")
def path(tiny_dir):
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def prompts():
    return [prompt_ids(1024, n, seed=100 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(path, prompts):
    """Each prompt run by itself (one request in the engine at a time)."""
    llm = LLM(model=path)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def token_ids(results):
    return [r.outputs[0].token_ids for r in results]


def test_batch_equals_alone_and_transformers(path, prompts, alone):
    """18 prompts of 1..150 tokens generated together equal each run alone, and transformers' greedy generate."""
    llm = LLM(model=path, max_num_batched_tokens=256)
    assert token_ids(llm.generate(prompts, GREEDY)) == alone
    hf = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, ours in zip(prompts, alone, strict=True):
        ref = hf_greedy(hf, p, 10)
        assert ours == ref, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("chunk", [1, 7, 16, 61])
def test_chunked_prefill_equals_unchunked(path, prompts, alone, chunk):
    """A step budget of 1, 7, 16 or 61 tokens (chunks that do not divide the prompts) gives the same outputs."""
    llm = LLM(model=path, max_num_batched_tokens=chunk)
    some = [0, 4, 9, 12, 15]
    assert token_ids(llm.generate([prompts[i] for i in some], GREEDY)) == [alone[i] for i in some]


def test_heavy_preemption_gives_identical_outputs_and_no_leaks(path, prompts, alone):
    """A cache of 24 blocks x 16 tokens and 4 slots forces many preemptions; outputs are unchanged, nothing leaks."""
    llm = LLM(model=path, num_blocks=24, num_state_slots=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    out = token_ids(llm.generate(prompts, GREEDY))
    sched = llm.engine.scheduler
    assert sched.num_preemptions >= 3, sched.num_preemptions
    assert out == alone
    usage = llm.engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_seeded_sampling_is_batch_invariant(path, prompts):
    """A seeded request samples the same tokens alone and inside two different batches."""
    llm = LLM(model=path)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    target = prompts[6]
    solo = llm.generate([target], seeded)[0].outputs[0].token_ids
    batch1 = llm.generate([prompts[1], target, prompts[10]], [other, seeded, GREEDY])[1].outputs[0].token_ids
    batch2 = llm.generate([target] + prompts[12:16], [seeded] + [other] * 4)[0].outputs[0].token_ids
    assert solo == batch1 == batch2


def test_n_outputs_and_logprobs(path, prompts):
    """n=3 gives three outputs (distinct seeds per child); logprobs carry the sampled token and top alternatives."""
    llm = LLM(model=path)
    res = llm.generate(
        [prompts[3]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)
    )[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1
    lp = res.outputs[0].logprobs
    assert len(lp) == 6 and all(x.token_id == t for x, t in zip(lp, res.outputs[0].token_ids, strict=True))
    assert all(len(x.top) == 2 and x.logprob <= 0 for x in lp)


def test_stop_string_trims_text_and_frees_request(path):
    """A stop string seen in the output text ends the request with the text cut before it."""
    llm = LLM(model=path)
    free = llm.generate(["def add(a, b):"], GREEDY)[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    out = llm.generate(
        ["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert not llm.engine.has_unfinished_requests()


def test_abort_mid_generation_frees_blocks_and_slot(path, prompts):
    """Aborting requests while they run (mid-prefill and mid-decode) returns all their blocks and slots."""
    llm = LLM(model=path, max_num_batched_tokens=32)
    engine = llm.engine
    for i, p in enumerate(prompts[:6]):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    for i in range(0, 6, 2):
        engine.abort_request(f"a{i}")
    while engine.has_unfinished_requests():
        engine.step()
    usage = engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_failed_step_ends_requests_frees_cache_and_engine_recovers(path, prompts, alone, monkeypatch):
    """A step that raises mid-forward (after writing its caches) leaves the engine usable: every request in it ends
    with an error (the one whose grammar failed to compile just before keeps its own error), every block, slot and
    pin is free, the prefix cache is forgotten (the step may have registered half-written blocks and states), and
    the next requests give the outputs of a fresh engine."""
    from deltaserve.sampling_params import StructuredOutput

    llm = LLM(model=path, max_num_batched_tokens=64)
    engine = llm.engine
    first = llm.generate([prompts[12]], GREEDY)[0].outputs[0].token_ids  # 150 tokens: cached blocks + checkpoints
    engine.add_request("hit", prompts[12] + first[:4] + [7, 8, 9], GREEDY)  # a prefix hit: its copies are pinned
    for i, p in enumerate(prompts[10:12]):
        engine.add_request(f"f{i}", p, GREEDY)
    engine.add_request("bad-grammar", [5, 6], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "(")))
    engine.structured.wait(timeout=30)  # the compile fails now; the failing step below admits (reports) it
    real_forward = engine.executor.worker.runner.model.forward

    def failing_forward(*args, **kwargs):
        real_forward(*args, **kwargs)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.executor.worker.runner.model, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    outputs = {o.request_id: o for o in engine.fail_unfinished("the step failed")}
    assert sorted(outputs) == ["bad-grammar", "f0", "f1", "hit"]
    assert "regex" in outputs["bad-grammar"].error
    assert all(outputs[r].error == "the step failed" for r in ("f0", "f1", "hit"))
    assert not engine.has_unfinished_requests()
    usage = engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots
    again = llm.generate(prompts[10:13], GREEDY)
    assert token_ids(again) == alone[10:13] and all(r.num_cached_tokens == 0 for r in again)
    # The workers dropped the failed step's requests with the next step's finished ids.
    assert not {"f0", "f1", "hit", "bad-grammar"} & set(engine.executor.worker.runner._requests)
