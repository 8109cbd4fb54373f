"""The decode roofline model (`bench/roofline.py`): byte accounting of real tiny models and the §4 formula."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.bench.roofline import DeviceCeilings, ModelBytes, measure_ceilings, model_bytes, roofline_share
from deltaserve.models.loader import load_model


def _all_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_model_bytes_of_the_base_tiny_model(tiny_dir):
    """Base tiny spec: 8 layers (6 KDA, 2 MLA), layer 0 dense, 7 MoE layers of 8 experts (top 2), hidden 256,
    expert width 128, KDA 4 heads x 32, MLA latent 64 + rope 16, fp32. Expected sizes computed from those numbers."""
    model = load_model(tiny_dir("base"), dtype=torch.float32)
    mb = model_bytes(model)
    assert (mb.num_moe_layers, mb.num_experts, mb.top_k) == (7, 8, 2)
    assert mb.expert_bytes == 3 * 256 * 128 * 4  # gate, up and down of one expert, fp32
    kda_slot = 4 * 32 * 32 * 4 + 3 * (3 * 4 * 32) * 4  # recurrent state + conv window of q, k, v (kernel 4 - 1)
    assert mb.state_bytes_per_seq == 6 * kda_slot
    assert mb.kv_bytes_per_token == 2 * (64 + 16) * 4
    embed = 1024 * 256 * 4
    # Every tensor is counted once: dense weights, all routed experts, and the (untied) embedding left out.
    assert mb.dense_bytes + mb.num_moe_layers * mb.num_experts * mb.expert_bytes + embed == _all_bytes(model)
    assert mb.active_params * 4 == mb.dense_bytes + 7 * 2 * mb.expert_bytes


def test_model_bytes_counts_mxfp4_experts_packed(tiny_dir):
    """K3 tiny spec: MXFP4 latent experts (latent 128, width 128): 4.25 bits per weight in bytes, 2 weights per byte."""
    model = load_model(tiny_dir("k3"), dtype=torch.bfloat16)
    mb = model_bytes(model)
    weights = 3 * 128 * 128
    assert mb.expert_bytes == weights // 2 + weights // 32  # packed nibbles + one E8M0 scale per 32 weights
    expert_params = mb.active_params - sum(
        t.numel() for n, t in [*model.named_parameters(), *model.named_buffers()]
        if ".w13" not in n and ".w2" not in n and n != "embed_tokens"
    )
    assert expert_params == mb.num_moe_layers * mb.top_k * weights


def test_step_bytes_follows_the_roofline_formula():
    mb = ModelBytes(dense_bytes=1000, expert_bytes=100, num_moe_layers=3, num_experts=8, top_k=2,
                    state_bytes_per_seq=50, kv_bytes_per_token=4, active_params=700)
    assert mb.experts_touched(1) == pytest.approx(2)  # one row touches exactly k experts
    assert mb.experts_touched(1000) == pytest.approx(8)  # many rows touch all of them
    touched = 8 * (1 - (1 - 2 / 8) ** 2)
    assert mb.step_bytes([10, 20]) == pytest.approx(1000 + 3 * touched * 100 + 2 * 2 * 50 + 4 * 30)
    assert mb.step_flops(2) == 2 * 700 * 2

    ceilings = DeviceCeilings(bandwidth=1e6, flops=1e12, source="test")
    share = roofline_share(mb, ceilings, [([10, 20], 0.01), ([11], 0.002)])
    bounds = [mb.step_bytes([10, 20]) / 1e6, mb.step_bytes([11]) / 1e6]  # memory-bound at these ceilings
    assert share.steps == 2 and share.mean_batch == 1.5
    assert share.share == pytest.approx((sum(bounds) / 2) / ((0.01 + 0.002) / 2))
    compute_bound = roofline_share(mb, DeviceCeilings(bandwidth=1e15, flops=1e3, source="test"), [([5], 1.0)])
    assert compute_bound.mean_bound_ms == pytest.approx(1e3 * mb.step_flops(1) / 1e3)
    assert roofline_share(mb, ceilings, []).share == 0.0


def test_measure_ceilings_on_cpu():
    c = measure_ceilings(torch.device("cpu"), torch.float32, nbytes=64 << 20)
    assert math.isfinite(c.bandwidth) and c.bandwidth > 1e8 and c.flops > 1e8 and "cpu" in c.source


def test_given_bandwidth_is_used_as_is():
    """--peak-bandwidth-gbs: no bandwidth probe (its 1 GiB tensor would be allocated for nothing), only the matmul."""
    c = measure_ceilings(torch.device("cpu"), torch.float32, nbytes=1 << 60, bandwidth=5e9)  # a probe would fail
    assert c.bandwidth == 5e9 and c.flops > 1e8 and "bandwidth given" in c.source
