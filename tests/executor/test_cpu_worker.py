"""The CPU worker's set-up: fast op backends chosen, bf16 weights packed once, subnormals flushed, threads sized from
the affinity mask."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve.config import EngineConfig
from deltaserve.executor.worker import Worker
from deltaserve.ops import dispatch
from deltaserve.ops.linear import onednn
from deltaserve.utils.cpu_threads import available_cores, default_num_threads


@pytest.mark.skipif(not onednn.available(), reason="no oneDNN bf16 linear in this torch on this CPU")
def test_bf16_worker_packs_its_weights_and_flushes_subnormals(tiny_dir, default_dispatch):
    worker = Worker(EngineConfig(model=str(tiny_dir("base")), dtype="bfloat16", num_threads=1))
    layer = worker.model.layers[1]
    assert layer.self_attn.in_proj.weight.is_mkldnn and worker.model.lm_head.is_mkldnn
    assert all(w.is_mkldnn for w in layer.mlp.w13) and torch.get_num_threads() == 1
    tiny = torch.tensor([1e-39])  # a subnormal float32
    assert (tiny * 1.0).item() == 0.0


def test_forced_reference_keeps_weights_plain(tiny_dir, default_dispatch):
    default_dispatch.setenv("DELTASERVE_OPS_BACKEND", "ref")
    dispatch.reset()
    worker = Worker(EngineConfig(model=str(tiny_dir("base")), dtype="bfloat16", num_threads=1))
    assert not worker.model.layers[1].self_attn.in_proj.weight.is_mkldnn


def test_cpu_worker_runs_the_fast_kernels(tiny_dir, default_dispatch):
    """On a CPU every hot op of a step has a fast backend before the reference (the engine parity tests in
    tests/engine and tests/models therefore check these kernels against transformers)."""
    table = dispatch.log_backends()
    packed_linear = ("linear",) if onednn.available() else ()  # oneDNN's bf16 path needs AVX512 or AVX-NE-CONVERT
    for name in ("kda_prefill", "short_conv_prefill", "mla_prefill", *packed_linear):
        assert table[name][0] != "ref", name


def test_default_threads_come_from_the_affinity_mask(monkeypatch: pytest.MonkeyPatch):
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5, 7})
    else:
        monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert available_cores() == 4
    assert default_num_threads() == 4 and default_num_threads(reserved=1) == 3
    monkeypatch.setattr("deltaserve.utils.cpu_threads.available_cores", lambda: 1)
    assert default_num_threads(reserved=1) == 1
