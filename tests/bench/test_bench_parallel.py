"""`bench memory-plan` (Kimi K3's per-rank plan, checked against the config arithmetic) and `bench parallel` (runs,
reports both engines and the collectives)."""

from __future__ import annotations

import pytest

from deltaserve.bench.memory_plan import MemoryPlanArgs
from deltaserve.bench.memory_plan import run as plan
from deltaserve.bench.parallel import ParallelBenchArgs
from deltaserve.bench.parallel import run as bench_parallel


def test_k3_tp8_plan_matches_the_config_arithmetic():
    r = plan(MemoryPlanArgs(tensor_parallel_size=8))
    kda_layers, mla_layers, heads = 69, 24, 96 // 8
    assert r["kv_bytes_per_token_per_rank"] == mla_layers * (512 + 64) * 2  # latent + rope key, bf16, whole
    state = kda_layers * (heads * 128 * 128 * 4 + 3 * heads * 128 * 3 * 4)  # fp32 state and K3's fp32 conv window
    assert r["state_mib_per_sequence_per_rank"] * 2**20 == state
    assert 200 < r["weights_per_rank_gb"] < 210
    unsharded = plan(MemoryPlanArgs(tensor_parallel_size=1, gpu_memory_gib=4000))
    assert 1.55 < unsharded["weights_all_ranks_tb"] < 1.57  # the published 1.56 TB checkpoint


def test_wider_expert_group_halves_the_expert_bytes():
    ep8 = plan(MemoryPlanArgs(tensor_parallel_size=8, enable_expert_parallel=True))
    ep16 = plan(MemoryPlanArgs(tensor_parallel_size=8, enable_expert_parallel=True, expert_parallel_size=16,
                               data_parallel_size=2, gpu_memory_gib=192))
    assert ep16["routed_expert_gb_per_rank"] == pytest.approx(ep8["routed_expert_gb_per_rank"] / 2)
    assert ep16["other_weights_gb_per_rank"] == ep8["other_weights_gb_per_rank"]
    with pytest.raises(SystemExit, match="exceed the usable memory"):
        plan(MemoryPlanArgs(tensor_parallel_size=8, gpu_memory_gib=192))


@pytest.mark.slow  # CI time
def test_bench_parallel_reports_both_engines(capsys):
    r = bench_parallel(ParallelBenchArgs(num_prompts=2, input_len=8, output_len=4, rounds=1, num_threads=1))
    assert set(r["ms_per_step"]) == {"uni TP=1", "mp TP=1", "mp TP=2"}
    assert all(v > 0 for v in r["ms_per_step"].values())
    assert r["all_reduces_per_step"] == 2 * 4 + 1 and r["all_reduce_ms"] > 0
    assert "collectives per decode step" in capsys.readouterr().out
