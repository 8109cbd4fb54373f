"""Decode steps padded to the CUDA graph sizes on static buffers (`deltaserve.runner.cuda_graphs`).

On a CPU nothing is captured: `DELTASERVE_CPU_DECODE_GRAPHS=1` runs the padded eager twin of a replay, the same
static buffers, padding rows and batch objects a captured graph reads; these tests check that it changes no output
and touches no request's cache. The capture itself runs in tests/engine/test_gpu.py (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.entrypoints.cli import build_parser
from deltaserve.layers.forward_batch import KDALayerCache, MLALayerCache
from deltaserve.runner.cuda_graphs import DecodeGraphs, GraphSettings, default_sizes
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk
from tests.helpers import prompt_ids

SIZES = (1, 2, 4, 8)


@pytest.fixture
def padded_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_CPU_DECODE_GRAPHS", "1")


def runner_of(llm: LLM) -> ModelRunner:
    runner = llm.engine.executor.worker.runner
    assert runner is not None
    return runner


def test_default_sizes_follow_vllm() -> None:
    assert default_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_sizes(3) == (1, 2)
    assert default_sizes(1) == (1,)
    assert default_sizes(4096)[-1] == 512


def test_bad_sizes_are_refused_naming_the_field(tiny_dir) -> None:
    for bad in ((0,), (), (2, -1), (1.5,), (True,)):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(model=str(tiny_dir("base")), cuda_graph_sizes=bad)  # type: ignore[arg-type]
    assert EngineConfig(model=str(tiny_dir("base")), cuda_graph_sizes=(8, 1, 8)).cuda_graph_sizes == (1, 8)


def test_cli_flags_reach_the_config() -> None:
    args = build_parser().parse_args(["serve", "--cuda-graph-sizes", "1", "2", "4", "--enforce-eager"])
    assert args.cuda_graph_sizes == [1, 2, 4] and args.enforce_eager
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--cuda-graph-sizes", "8"])
    assert args.cuda_graph_sizes == [8] and not args.enforce_eager


@pytest.mark.parametrize("variant", ["base", pytest.param("k3", marks=pytest.mark.slow)])
def test_padded_decode_equals_eager_with_preemption_and_prefix_hits(tiny_dir, padded_decode, variant) -> None:
    """Prompts of mixed lengths and output lengths (the decode batch shrinks through every size, and is above the
    largest at first), a cache small enough to preempt, then the same prompts again (prefix-cache hits): greedy and
    seeded sampled tokens equal the eager engine's, and padded steps ran."""
    path = str(tiny_dir(variant))
    prompts = [prompt_ids(1024, n, seed=300 + i) for i, n in enumerate((3, 17, 40, 5, 64, 9, 33, 21, 2, 50, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    params[3] = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for _ in range(2) for o in llm.generate(prompts, params)]

    cache = {"num_blocks": 16, "num_state_slots": 10, "max_num_batched_tokens": 64}
    eager = run(LLM(model=path, enforce_eager=True, **cache))
    llm = LLM(model=path, cuda_graph_sizes=SIZES, **cache)
    runner = runner_of(llm)
    assert runner.graphs is not None and runner.graphs.sizes == SIZES and not runner.graphs.captured
    assert run(llm) == eager
    assert runner.graphs.replays > 0
    assert llm.engine.scheduler.num_preemptions > 0
    usage = llm.engine.cache.usage()
    assert usage.num_free_slots == usage.num_slots


def test_enforce_eager_and_a_vision_tower_keep_steps_unpadded(tiny_dir, padded_decode) -> None:
    """`enforce_eager`, and a vision tower (image features replace token embeddings: the embedded model has one),
    leave the runner without decode graphs; otherwise it has them. (The block-drafter condition has no test of its
    own: the one shipped drafter belongs to the embedded model, whose vision tower turns graphs off first.)"""
    assert runner_of(LLM(model=str(tiny_dir("base")), enforce_eager=True)).graphs is None
    assert runner_of(LLM(cuda_graph_sizes=(1, 2))).graphs is None
    llm = LLM(model=str(tiny_dir("base")), cuda_graph_sizes=(1, 2))
    assert runner_of(llm).graphs is not None


def test_without_the_variable_a_cpu_engine_has_no_graphs(tiny_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASERVE_CPU_DECODE_GRAPHS", raising=False)
    assert runner_of(LLM(model=str(tiny_dir("base")), cuda_graph_sizes=(1, 2))).graphs is None


def test_padding_rows_write_only_the_pad_block_and_slot(tiny_dir) -> None:
    """A step of 3 decode rows at size 8 after a step of 8: the 5 padding rows write the block and slot past the
    pools (which no request holds), never the slots and blocks the earlier step's rows left in the buffers."""
    llm = LLM(model=str(tiny_dir("base")), enforce_eager=True)
    model = runner_of(llm).model
    block_size, num_blocks, num_slots = 16, 24, 10
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                         graphs=GraphSettings(sizes=SIZES, max_blocks=4, capture=False))
    graphs = runner.graphs
    assert isinstance(graphs, DecodeGraphs) and (graphs.pad_block, graphs.pad_slot) == (num_blocks, num_slots)
    # Eight sequences prefilled (4 tokens each, one block each), then one decode step of all eight.
    prompts = [[5 + i, 9, 33, 7] for i in range(8)]
    runner.execute_model([ScheduledChunk(request_id=str(i), new_token_ids=p, num_computed_tokens=0, state_slot=i,
                                         block_ids=[i], reset_state=True) for i, p in enumerate(prompts)])

    def decode(rows: range) -> torch.Tensor:
        return runner.execute_model([ScheduledChunk(request_id=str(i), new_token_ids=[11], num_computed_tokens=4,
                                                    state_slot=i, block_ids=[i]) for i in rows])

    decode(range(8))
    before = [(c.state.clone(), c.conv.clone()) if isinstance(c, KDALayerCache) else c.kv.clone()
              for c in runner.caches]
    replays = graphs.replays
    logits = decode(range(3))
    assert graphs.replays == replays + 1 and logits.shape[0] == 3
    for cache, old in zip(runner.caches, before, strict=True):
        if isinstance(cache, KDALayerCache):
            state, conv = old
            for slot in range(3, num_slots):  # rows 3..7 held these slots a step ago; now padding
                assert torch.equal(cache.state[slot], state[slot]) and torch.equal(cache.conv[slot], conv[slot])
            assert not torch.equal(cache.state[num_slots], state[num_slots])  # the pad slot took the padding rows
        else:
            assert isinstance(cache, MLALayerCache)
            assert torch.equal(cache.kv[3:num_blocks], old[3:num_blocks])
    # The same three rows run unpadded on an eager runner with the same caches give the same tokens.
    eager = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots)
    for mine, theirs in zip(eager.caches, before, strict=True):
        if isinstance(mine, KDALayerCache):
            mine.state.copy_(theirs[0][:num_slots])
            mine.conv.copy_(theirs[1][:num_slots])
        else:
            mine.kv.copy_(theirs[:num_blocks])
    reference = eager.execute_model([ScheduledChunk(request_id=str(i), new_token_ids=[11], num_computed_tokens=4,
                                                    state_slot=i, block_ids=[i]) for i in range(3)])
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    # Not bit for bit: fp32 GEMMs of 8 rows and of 3 may take other kernels (as batched and alone rows do).
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_the_planner_reserves_the_padding_block_and_slot(tiny_dir, padded_decode) -> None:
    """With padded decode steps the worker reports it and the planner takes the padding rows' block and slot out of
    the same cache budget: the pools are smaller than without, never the memory larger."""
    path = str(tiny_dir("base"))
    plain = LLM(model=path, enforce_eager=True, cache_memory="1MiB").engine
    padded = LLM(model=path, cache_memory="1MiB").engine
    assert not plain.executor.describe().decode_graphs and padded.executor.describe().decode_graphs
    a, b = plain.cache.usage(), padded.cache.usage()
    assert b.num_slots <= a.num_slots and b.num_blocks <= a.num_blocks
    assert (b.num_blocks, b.num_slots) != (a.num_blocks, a.num_slots), (a, b)


def test_sequences_longer_than_max_seq_len_to_capture_decode_eagerly(tiny_dir, padded_decode) -> None:
    """Graphs cover block tables up to `max_seq_len_to_capture` tokens (with room for the step's token): once a
    sequence outgrows them its steps run eagerly, with the same tokens."""
    path, prompt = str(tiny_dir("base")), prompt_ids(1024, 20, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    eager = LLM(model=path, enforce_eager=True).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(model=path, cuda_graph_sizes=(1, 2), max_seq_len_to_capture=31)
    graphs = runner_of(llm).graphs
    assert graphs is not None and graphs.max_blocks == 2  # 32 tokens of 16-token blocks
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == eager
    assert 0 < graphs.replays < 29  # decode steps at contexts 21..32 replayed, the rest eager
    with pytest.raises(ValueError, match="max_seq_len_to_capture"):
        EngineConfig(model=path, max_seq_len_to_capture=0)
