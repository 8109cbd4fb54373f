"""The block drafter's compiled graphs (`runner/drafter_graphs.py`): a real AOTInductor graph against the eager
drafter, padded batches, the compile cache, and the fall-back to eager when compiling fails. The engine with graphs
compiling in the background is tested in tests/spec_decode/test_dspark.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from deltaserve.models.dspark import DSparkConfig, DSparkDrafter
from deltaserve.runner.drafter_graphs import DrafterGraphs, bucket_of


def drafter(seed: int) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DSparkConfig(vocab_size=64, hidden_size=32, tap_layers=(0, 1), num_layers=1, num_heads=4,
                       intermediate_size=48, block_size=3, context_window=4)
    return DSparkDrafter(cfg).init_for_training().eval().requires_grad_(False)


def inputs(d: DSparkDrafter, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = d.config
    valid = torch.ones(batch, cfg.context_window, dtype=torch.bool)
    valid[0, :2] = False  # a window not yet full
    return torch.randn(batch, cfg.context_window, cfg.feature_size), valid, torch.randn(batch, cfg.hidden_size)


pytestmark = pytest.mark.usefixtures("one_thread")


def no_compile(*_args) -> None:
    raise AssertionError("compiled although the cache has the graph")


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler")
@torch.inference_mode()
def test_compiled_graph_matches_eager_and_is_cached(tmp_path: Path):
    """One real compile (bucket 4): batches of 3 (padded) and 4 match the eager drafter; a second `DrafterGraphs` of
    the same drafter loads the graph from the cache without compiling; other weights miss the cache."""
    d = drafter(0)
    graphs = DrafterGraphs(d, cache_dir=tmp_path)
    x3 = inputs(d, 3)
    assert torch.equal(graphs(*x3), d(*x3))  # no graph yet: the eager drafter, and a compile queued
    job = graphs.job(3)
    assert job is not None
    job.result(timeout=600)
    assert graphs.ready(3) and graphs.ready(4) and not graphs.ready(1)
    for batch in (3, 4):
        x = inputs(d, batch)
        out = graphs(*x)
        assert out.shape == (batch, 3, 32)
        torch.testing.assert_close(out, d(*x), rtol=1e-5, atol=1e-5)
    assert graphs(*inputs(d, 4), num_drafts=2).shape == (4, 2, 32)  # fewer drafts: eager (no graph for them)

    again = DrafterGraphs(d, cache_dir=tmp_path, compile_fn=no_compile)
    x = inputs(d, 4)
    torch.testing.assert_close(again(*x), d(*x), rtol=1e-5, atol=1e-5)
    assert again.ready(4) and again.job(4) is None
    other = DrafterGraphs(drafter(1), cache_dir=tmp_path, compile_fn=no_compile)
    assert not other.ready(4)
    other(*inputs(other.drafter, 4))
    assert other.job(4) is not None  # queued: no_compile fails it, which `other` reports when it next looks


@torch.inference_mode()
def test_failed_compile_runs_eagerly_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    def broken(*_args) -> None:
        raise RuntimeError("no C++ compiler here")

    d = drafter(0)
    graphs = DrafterGraphs(d, cache_dir=tmp_path, compile_fn=broken)
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.drafter_graphs"):
        for batch in (1, 2, 3):
            graphs(*inputs(d, batch))
        for batch in (1, 2, 3):
            job = graphs.job(batch)
            assert job is not None and isinstance(job.exception(timeout=60), RuntimeError)
        for batch in (1, 2, 3, 1):
            x = inputs(d, batch)
            assert torch.equal(graphs(*x), d(*x))
    assert not graphs.enabled
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no C++ compiler here" in caplog.records[0].getMessage()
    assert "eagerly" in caplog.records[0].getMessage()
