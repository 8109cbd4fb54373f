"""Shared fixtures: tiny random checkpoints written once per session; the `gpu` marker skips without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (the `interpret` tests: kernels against their references on a
# CPU). Set before anything imports triton (deltaserve's imports may: torch._dynamo imports it where it is installed):
# its standard library is jitted for the mode in force at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint  # noqa: E402
from deltaserve.utils.hf_kimi import kimi_linear_for_causal_lm  # noqa: E402

# Every engine a test starts (in this process, and the servers and workers it spawns, which inherit the variable)
# gets this cache unless the test sizes it: the 2 GiB default, zeroed at start, cost the suite minutes and, with a
# few engines alive at once, most of the CI machine's memory. Tiny checkpoints need a few MiB.
os.environ.setdefault("DELTASERVE_CACHE_MEMORY", "256MiB")
# The block drafter's compiled graphs (runner/drafter_graphs.py) would start compiling in the background of every
# dspark engine: seconds of a CI core each, and drafts that change (within rounding) the moment a graph is ready.
# tests/runner/test_drafter_graphs.py turns them on where it tests them.
os.environ.setdefault("DELTASERVE_DRAFTER_GRAPHS", "0")
# transformers' Kimi Linear, the parity oracle, imported before anything else can: with fla hidden, so that it runs
# its own PyTorch KDA (with fla-core installed, the kernels extra, it would call fla's Triton kernels, which fail on a
# CPU and would not be an independent oracle on a GPU).
try:
    kimi_linear_for_causal_lm()
except ImportError:  # no transformers (the tests that need it skip)
    pass

# Variants that exercise the paths the parity tests must cover (see model-spec §13.1).
TINY_VARIANTS: dict[str, TinySpec] = {
    "base": TinySpec(),
    "qlora-2shared-bsmoe": TinySpec(q_lora_rank=48, shared_experts=2, dense_name="block_sparse_moe", seed=1),
    "odd-sizes": TinySpec(
        layers=5, hidden=72, kda_heads=3, kda_head_dim=24, mla_heads=3, qk_nope_head_dim=20, qk_rope_head_dim=12,
        v_head_dim=28, kv_lora_rank=40, experts=7, top_k=3, num_expert_group=1, topk_group=1, intermediate=136,
        moe_intermediate=40, first_k_dense=2, vocab=700, seed=2, shard_bytes=400_000,
    ),
    "no-dense-4groups": TinySpec(
        layers=4, first_k_dense=0, experts=12, top_k=3, num_expert_group=4, topk_group=2, seed=3,
    ),
    # Kimi K3 (model-spec §1, §3-§7, §10): q-LoRA and 2 shared experts as K3, MXFP4 experts, Block AttnRes of 3 layers.
    "k3": TinySpec(arch="kimi_k3", q_lora_rank=48, shared_experts=2, routed_scaling_factor=1.0, seed=4),
    "k3-gpt-oss": TinySpec(arch="kimi_k3", q_lora_rank=48, shared_experts=2, routed_scaling_factor=1.0, seed=4,
                           expert_format="gpt-oss"),
    "k3-odd": TinySpec(
        arch="kimi_k3", layers=5, hidden=72, kda_heads=3, kda_head_dim=24, mla_heads=3, qk_nope_head_dim=20,
        qk_rope_head_dim=12, v_head_dim=28, kv_lora_rank=40, experts=7, top_k=3, num_expert_group=1, topk_group=1,
        intermediate=136, moe_intermediate=64, latent_size=32, first_k_dense=2, attn_res_block_size=2, vocab=700,
        seed=5, shard_bytes=300_000,
    ),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> callable:
    """tiny_dir(name) -> path of the tiny checkpoint variant `name`, written on first use."""
    made: dict[str, Path] = {}

    def get(name: str = "base") -> Path:
        if name not in made:
            made[name] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), TINY_VARIANTS[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a test module: every float (and so every sampled token) is the same whatever the
    machine's core count, and on a shared two-core machine tiny forwards take seconds, not minutes (OpenMP threads
    waiting for each other). Drafter graphs are compiled for the count in force, which is then 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_torch_process_settings():
    """An engine built with `num_threads` sets torch's process-wide thread count; restore it after each test, so a
    later test does not run with another thread count (GEMM results differ with it, and a worker process started by
    a later test keeps torch's default: its floats would then differ from the in-process run's)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)  # a CPU worker flushes subnormals; the op tests check exact subnormal values


@pytest.fixture
def default_dispatch(monkeypatch: pytest.MonkeyPatch):
    """Op dispatch as configured by default (no DELTASERVE_OPS_BACKEND), re-read before and after the test; yields
    the monkeypatch, to force backends with `setenv` followed by `dispatch.reset()`."""
    from deltaserve.ops import dispatch

    monkeypatch.delenv("DELTASERVE_OPS_BACKEND", raising=False)
    dispatch.reset()
    yield monkeypatch
    monkeypatch.delenv("DELTASERVE_OPS_BACKEND", raising=False)
    dispatch.reset()
