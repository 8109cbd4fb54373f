"""`deltaserve bench cpu` on a tiny checkpoint: probes run in fresh processes from this tree and from a worktree of
another commit, alternating, and report tokens/s, ratios and the decode bandwidth share."""

from __future__ import annotations

import subprocess

import pytest

from deltaserve.bench.cpu import REPO, CpuBenchArgs, run


@pytest.mark.slow  # CI time: builds a baseline commit
def test_bench_cpu_against_a_baseline_commit(tiny_dir):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    result = run(CpuBenchArgs(model=str(tiny_dir("base")), baseline_rev="HEAD", threads="1", dtypes="float32",
                              workloads="decode,prefill", rounds=1))
    decode, prefill = result["rows"]
    for row in (decode, prefill):
        assert row["this tree"] > 0 and row["HEAD"] > 0
        assert row["ratio"] == pytest.approx(row["this tree"] / row["HEAD"])
    # Counted bytes over measured time, against a measured bandwidth: a real fraction (timing decides its size).
    assert decode["decode_gbs"] > 0 and 0 < decode["bandwidth_share"] < 2
    assert "bandwidth_share" not in prefill
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert "deltaserve-bench-cpu" not in listed  # the worktree is removed


def test_bench_cpu_refuses_unknown_workloads():
    with pytest.raises(ValueError, match="workloads: unknown"):
        CpuBenchArgs(workloads="decode,warp")
