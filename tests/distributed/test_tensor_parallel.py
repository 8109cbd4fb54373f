"""Tensor and expert parallelism over real worker processes (gloo on this CPU): greedy outputs identical to one
rank, with chunked prefill and batching, on the transformers parity checkpoints and Kimi K3 (MXFP4 experts, both
layouts); with speculation and prefix-cache hits; bad splits refused in one line before any worker starts."""

from __future__ import annotations

import pytest

from deltaserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.executor.multiproc import MultiprocExecutor
from deltaserve.sampling_params import SamplingParams
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def requests(vocab: int) -> dict[str, list[int]]:
    """Prompts that end on and off the 16-token block boundary, one longer than a 32-token chunk, a repeated one."""
    long = prompt_ids(vocab, 70, seed=1)
    return {"long": long, "block": prompt_ids(vocab, 32, seed=2), "short": prompt_ids(vocab, 5, seed=3),
            "odd": prompt_ids(vocab, 23, seed=4), "repeat": long[:40] + long[:30]}


def run(path: str, parallel: ParallelConfig, reqs: dict[str, list[int]], *, spec: SpeculativeConfig | None = None,
        rounds: int = 1) -> tuple[list[dict[str, list[int]]], EngineCore]:
    """Greedy tokens per request, `rounds` times in a row on one engine (later rounds hit the prefix cache)."""
    core = EngineCore(EngineConfig(model=path, parallel=parallel, speculative_config=spec,
                                   scheduler=SchedulerConfig(max_num_batched_tokens=32),
                                   cache=CacheConfig(cache_memory="64MiB")))
    results = []
    try:
        for r in range(rounds):
            out: dict[str, list[int]] = {rid: [] for rid in reqs}
            for rid, prompt in reqs.items():
                core.add_request(f"{rid}-{r}", prompt, GREEDY)
            while core.has_unfinished_requests():
                for o in core.step():
                    out[o.request_id.rsplit("-", 1)[0]] += o.new_token_ids
            results.append(out)
    finally:
        core.shutdown()
    return results, core


_single: dict[str, dict[str, list[int]]] = {}


def single(path: str, reqs: dict[str, list[int]]) -> dict[str, list[int]]:
    if path not in _single:
        _single[path] = run(path, ParallelConfig(), reqs)[0][0]
    return _single[path]


@pytest.mark.parametrize(("variant", "tp", "ep"), [
    # CI time: TP4 runs on base, EP on no-dense-4groups and k3-gpt-oss; q-LoRA and shared experts on k3.
    ("base", 2, False), ("base", 4, False), ("no-dense-4groups", 2, True), ("k3", 2, False), ("k3-gpt-oss", 2, True),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("qlora-2shared-bsmoe", 2, False), ("base", 2, True), ("k3", 2, True), ("k3", 4, False),
        ("k3-gpt-oss", 2, False)]),
])
def test_parallel_greedy_equals_one_rank(tiny_dir, variant, tp, ep):
    path = str(tiny_dir(variant))
    reqs = requests(600)
    (got,), core = run(path, ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep), reqs)
    assert isinstance(core.executor, MultiprocExecutor) and core.executor.world_size == tp
    assert got == single(path, reqs)
    assert all(len(t) == GREEDY.max_tokens for t in got.values())


def test_tp2_with_speculation_and_prefix_hits_equals_one_rank(tiny_dir):
    """n-gram speculation (scratch state slots per rank) and a second round served from the prefix cache."""
    path = str(tiny_dir("base"))
    reqs = requests(600)
    spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3})
    (first, second), core = run(path, ParallelConfig(tensor_parallel_size=2), reqs, spec=spec, rounds=2)
    assert first == second == single(path, reqs)
    assert core.cache.prefix_stats().hit_tokens > 0


@pytest.mark.parametrize(("variant", "parallel", "needle"), [
    ("odd-sizes", ParallelConfig(tensor_parallel_size=2), r"linear_attn_config.num_heads=3 is not divisible by "
                                                           r"tensor_parallel_size=2"),
    ("odd-sizes", ParallelConfig(tensor_parallel_size=3, enable_expert_parallel=True),
     r"intermediate_size=136 is not divisible by tensor_parallel_size=3"),
    ("base", ParallelConfig(tensor_parallel_size=3, enable_expert_parallel=True),
     r"linear_attn_config.num_heads=4 is not divisible by tensor_parallel_size=3"),
    ("k3", ParallelConfig(tensor_parallel_size=8), r"is not divisible by tensor_parallel_size=8|MXFP4 block"),
])
def test_bad_split_is_a_one_line_error(tiny_dir, variant, parallel, needle):
    with pytest.raises(ValueError, match=needle) as err:
        EngineCore(EngineConfig(model=str(tiny_dir(variant)), parallel=parallel))
    assert "\n" not in str(err.value)


def test_uni_backend_with_several_ranks_is_refused():
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
