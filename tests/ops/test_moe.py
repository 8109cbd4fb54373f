"""Parity of deltaserve.ops.moe (noaux_tc routing, grouped SiLU-GLU experts; spec §5) and silu_and_mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts, KimiLinearTopkRouter

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe.ref import moe_experts, moe_route

HIDDEN, INTER = 40, 12


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    """Fail on NaN, shape or dtype mismatch, or a max-abs error above ``rtol * max|ref|``; report both errors."""
    assert not torch.isnan(out).any(), f"{name}: output has NaN"
    assert not torch.isnan(ref).any(), f"{name}: reference has NaN"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    abs_err = (out.double() - ref.double()).abs().max().item()
    rel_err = abs_err / max(ref.double().abs().max().item(), 1e-30)
    assert rel_err <= rtol, f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} > {rtol:.1e}"


def make_config(num_experts: int, top_k: int, n_group: int, topk_group: int) -> KimiLinearConfig:
    config = KimiLinearConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        moe_intermediate_size=INTER,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_expert_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.446,
        moe_renormalize=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._experts_implementation = "eager"
    return config


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows re-ordered by expert id, so unsorted and sorted top-k compare as sets."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


ROUTER_CASES = [
    pytest.param(10, 3, 2, 1, id="E10-k3-groups2-keep1"),
    pytest.param(12, 4, 4, 2, id="E12-k4-groups4-keep2"),
    pytest.param(7, 2, 1, 1, id="E7-k2-nogroups"),
]


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group"), ROUTER_CASES)
def test_moe_route_matches_transformers(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """moe_route picks the same expert set with the same weights as KimiLinearTopkRouter (biased selection)."""
    g = torch.Generator().manual_seed(num_experts)
    router = KimiLinearTopkRouter(make_config(num_experts, top_k, n_group, topk_group))
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, HIDDEN, generator=g) * 1.5 / HIDDEN**0.5)
        router.e_score_correction_bias.copy_(0.2 * torch.randn(num_experts, generator=g))
    x = torch.randn(29, HIDDEN, generator=g)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    weights, ids = moe_route(
        x.float() @ router.weight.float().T,
        router.e_score_correction_bias,
        top_k=top_k,
        num_expert_group=n_group,
        topk_group=topk_group,
        renormalize=True,
        routed_scaling_factor=2.446,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    ref_w, ref_ids = sorted_by_id(ref_w, ref_ids)
    weights, ids = sorted_by_id(weights, ids)
    assert torch.equal(ids, ref_ids)
    assert_close("moe_route_weights", ref_w, weights, 1e-6)


def test_moe_route_group_masking() -> None:
    """Groups are ranked by the sum of their top-2 biased scores; experts of dropped groups are never chosen."""
    probs = torch.tensor([[0.90, 0.85, 0.10, 0.10, 0.95, 0.20, 0.20, 0.20]])  # group sums 1.75 vs 1.15
    logits = torch.log(probs / (1 - probs))
    kwargs = {"top_k": 2, "renormalize": False, "routed_scaling_factor": 1.0}
    weights, ids = moe_route(logits, None, num_expert_group=2, topk_group=1, **kwargs)
    assert sorted(ids[0].tolist()) == [0, 1]  # expert 4 has the best score but its group loses
    assert_close("grouped_weights", probs[:, [0, 1]], weights.gather(1, ids.argsort(dim=-1)), 1e-6)
    _, ids = moe_route(logits, None, num_expert_group=1, topk_group=1, **kwargs)
    assert sorted(ids[0].tolist()) == [0, 4]
    _, ids = moe_route(logits, None, num_expert_group=2, topk_group=2, **kwargs)  # all groups kept: no-op
    assert sorted(ids[0].tolist()) == [0, 4]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0])  # group 1 now sums 0.95+0.7 = 1.65 < 1.75
    weights, ids = moe_route(logits, bias, num_expert_group=2, topk_group=1, **kwargs)
    assert sorted(ids[0].tolist()) == [0, 1]
    bias[5] = 0.7  # group 1: 0.95 + 0.9 = 1.85 > 1.75, and expert 5 (biased 0.9) beats expert 6 (0.7)
    weights, ids = moe_route(logits, bias, num_expert_group=2, topk_group=1, **kwargs)
    order = ids.argsort(dim=-1)
    assert ids.gather(1, order)[0].tolist() == [4, 5]
    assert_close("bias_not_in_weights", probs[:, [4, 5]], weights.gather(1, order), 1e-6)


def test_moe_route_softmax_scoring() -> None:
    """softmax scoring normalises over all E experts before selection; unknown scoring_func is rejected by name."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(13, 9, generator=g) * 2
    bias = 0.05 * torch.randn(9, generator=g)
    weights, ids = moe_route(
        logits,
        bias,
        top_k=3,
        num_expert_group=1,
        topk_group=1,
        renormalize=True,
        routed_scaling_factor=1.5,
        scoring_func="softmax",
    )
    scores = logits.softmax(dim=-1)
    ref_ids = (scores + bias).topk(3, dim=-1).indices
    ref_w = scores.gather(1, ref_ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 1.5
    assert torch.equal(ids, ref_ids)
    assert_close("softmax_weights", ref_w, weights, 1e-6)
    with pytest.raises(ValueError, match="scoring_func"):
        moe_route(
            logits,
            bias,
            top_k=3,
            num_expert_group=1,
            topk_group=1,
            renormalize=True,
            routed_scaling_factor=1.0,
            scoring_func="relu",
        )


def naive_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Per-token, per-slot float64 loop over the chosen experts."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(INTER)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(g: torch.Generator, num_experts: int, num_tokens: int, top_k: int):
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 1.5 / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=g) * 1.5 / INTER**0.5
    ids = torch.stack([torch.randperm(num_experts - 2, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return x, w13, w2, weights, ids  # experts E-2 and E-1 never receive tokens


@pytest.mark.parametrize("num_tokens", [pytest.param(1, id="T1"), pytest.param(23, id="T23")])
def test_moe_experts(num_tokens: int) -> None:
    """Grouped experts == transformers KimiLinearExperts (fp32) and a naive per-token float64 loop."""
    num_experts, top_k = 7, 3
    g = torch.Generator().manual_seed(num_tokens)
    x, w13, w2, weights, ids = random_experts(g, num_experts, num_tokens, top_k)
    experts = KimiLinearExperts(make_config(num_experts, top_k, 1, 1))
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        ref = experts(x, ids, weights)
    out = moe_experts(x, w13, w2, weights, ids)
    assert out.dtype == x.dtype
    assert_close("moe_experts_vs_transformers", ref, out, 1e-6)
    assert_close("moe_experts_vs_naive_fp64", naive_experts(x, w13, w2, weights, ids), out, 1e-6)


def test_moe_experts_bf16_matches_transformers() -> None:
    """In bf16 the expert output is weighted in fp32 and accumulated in bf16, as transformers does."""
    num_experts, top_k = 7, 2
    g = torch.Generator().manual_seed(7)
    x, w13, w2, weights, ids = random_experts(g, num_experts, 17, top_k)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    experts = KimiLinearExperts(make_config(num_experts, top_k, 1, 1)).bfloat16()
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        ref = experts(x, ids, weights)
    out = moe_experts(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert_close("moe_experts_bf16", ref, out, 1e-2)


def test_silu_and_mul() -> None:
    """silu_and_mul takes the gate from the first half and the up projection from the second."""
    g = torch.Generator().manual_seed(8)
    gate_up = torch.randn(5, 3, 2 * INTER, generator=g)
    out = silu_and_mul(gate_up)
    ref = gate_up[..., :INTER] * torch.sigmoid(gate_up[..., :INTER]) * gate_up[..., INTER:]
    assert_close("silu_and_mul", ref, out, 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("num_tokens", [1, 5, 32, 300, 2100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_experts_sorted_path_matches_reference(num_tokens, dtype):
    """The sorted grouped-GEMM fast path equals the grouped reference (experts with no tokens included)."""
    from deltaserve.ops import moe as dispatch
    from deltaserve.ops.moe import sorted as sorted_path

    g = torch.Generator().manual_seed(num_tokens)
    e, k, d, i = 8, 2, 40, 24
    x = torch.randn(num_tokens, d, generator=g, dtype=dtype)
    w13 = torch.randn(e, 2 * i, d, generator=g, dtype=dtype) / d**0.5
    w2 = torch.randn(e, d, i, generator=g, dtype=dtype) / i**0.5
    weights, ids = moe_route(torch.randn(num_tokens, e, generator=g), None, top_k=k, num_expert_group=1,
                             topk_group=1, renormalize=True, routed_scaling_factor=2.0)
    ref = moe_experts(x, w13, w2, weights, ids)
    out = sorted_path.moe_experts_sorted(x, w13, w2, weights, ids)
    # The same per-expert GEMMs on the same rows in the same order: identical, not merely close.
    assert torch.equal(ref, out), (ref - out).abs().max()
    if dispatch.moe_experts.select(x, w13, w2, weights, ids) == "ref":  # type: ignore[attr-defined]
        assert torch.equal(ref, dispatch.moe_experts(x, w13, w2, weights, ids))


def test_moe_experts_on_cpu_loop_over_the_experts_with_tokens():
    """On a CPU, past the C kernel's few pairs and below `cpu_dense`'s many, the reference serves the call: torch's
    CPU grouped GEMM would loop over every expert, empty ones included, where the reference loops over those that
    received tokens."""
    from deltaserve.ops.moe import moe_experts as dispatched
    from deltaserve.ops.moe import native

    x, w13, w2 = torch.randn(9, 32), torch.randn(32, 48, 32), torch.randn(32, 32, 24)
    weights, ids = torch.rand(9, 2), torch.arange(18).view(9, 2)  # 18 pairs: more than MAX_PAIRS, fewer than experts
    assert dispatched.select(x, w13, w2, weights, ids) == "ref"  # type: ignore[attr-defined]
    few = "native" if native.available() else "ref"
    assert dispatched.select(x[:3], w13, w2, weights[:3], ids[:3]) == few  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype, d, i", [(torch.float64, 40, 24), (torch.float32, 63, 24), (torch.float32, 40, 25)],
                         ids=["fp64", "odd-hidden", "odd-intermediate"])
def test_moe_experts_without_a_grouped_kernel_run_the_reference(dtype, d, i):
    """grouped_mm has no fp64 kernel and needs 16-byte rows: fp64 (the tests' high-precision runs) and odd sizes
    keep the reference loop."""
    from deltaserve.ops import moe as dispatch
    from deltaserve.ops.moe import sorted as sorted_path

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, d, generator=g, dtype=dtype)
    w13 = torch.randn(8, 2 * i, d, generator=g, dtype=dtype)
    w2 = torch.randn(8, d, i, generator=g, dtype=dtype)
    weights, ids = moe_route(torch.randn(6, 8, generator=g), None, top_k=2, num_expert_group=1, topk_group=1,
                             renormalize=True, routed_scaling_factor=1.0)
    meta = [t.to("meta") for t in (x, w13, w2)]  # a non-CPU device: only dtypes and shapes decide
    assert not sorted_path.supports(*meta)
    assert sorted_path.supports(meta[0][:, :32].float(), meta[1][..., :32].float(), meta[2][..., :16].float())
    got = dispatch.moe_experts(x, w13, w2, weights, ids)
    if dispatch.moe_experts.select(x, w13, w2, weights, ids) == "ref":  # type: ignore[attr-defined]
        assert torch.equal(got, moe_experts(x, w13, w2, weights, ids))
    else:  # small stacks under many pairs: every expert at once (cpu_dense), within the reference's tolerance
        assert_close("dense", moe_experts(x, w13, w2, weights, ids), got, 1e-6 if dtype != torch.float64 else 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp32_combine", [False, True])
def test_cpu_dense_experts_match_the_reference(dtype, fp32_combine):
    """Every expert on every token (`cpu_dense`) == the reference loop within its tolerance: 8 tokens top-2 of 8
    experts, two experts never picked, a pair another expert-parallel rank holds (-1), SiLU-GLU and K3's SiTU."""
    import functools

    from deltaserve.ops.activation import situ_and_mul
    from deltaserve.ops.moe import cpu_dense

    g = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = random_experts(g, 8, 8, 2)
    ids[3, 1] = -1
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    for act in (silu_and_mul, functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0, interleaved=True)):
        assert cpu_dense.supports(x, w13, w2, weights, ids, act=act, fp32_combine=fp32_combine)
        want = moe_experts(x, w13, w2, weights, ids, act=act, fp32_combine=fp32_combine)
        got = cpu_dense.moe_experts_dense(x, w13, w2, weights, ids, act=act, fp32_combine=fp32_combine)
        assert got.dtype == dtype
        assert_close("cpu_dense", want, got, 1e-6 if dtype == torch.float32 else 1e-2)


def test_cpu_dense_experts_only_where_the_waste_is_small():
    """Taken for at least as many routed pairs as experts and small stacks; not for a decode row of 8 experts
    top-2, a big stack, MXFP4-style linears, fp64 or non-CPU tensors."""
    from deltaserve.ops.linear import linear as ops_linear
    from deltaserve.ops.moe import cpu_dense
    from deltaserve.ops.moe import moe_experts as dispatched

    x, w13, w2 = torch.randn(9, 32), torch.randn(8, 48, 32), torch.randn(8, 32, 24)
    weights, ids = torch.rand(9, 2), torch.randint(0, 8, (9, 2))
    assert dispatched.select(x, w13, w2, weights, ids) == "cpu_dense"  # type: ignore[attr-defined]
    assert cpu_dense.supports(x, w13, w2, weights, ids, linear=ops_linear)  # what the MoE layer passes on a CPU
    assert not cpu_dense.supports(x[:3], w13, w2, weights[:3], ids[:3])  # 6 pairs, 8 experts
    big_x, big_w13, big_w2 = (torch.zeros(1, 1, 1).expand(*shape) for shape in ((1, 8, 1024), (8, 2048, 1024),
                                                                                    (8, 1024, 1024)))
    assert not cpu_dense.supports(big_x[0], big_w13, big_w2, weights, ids)  # 8 x 8 x 3072 x 1024 multiply-adds
    assert not cpu_dense.supports(x, w13, w2, weights, ids, linear=lambda a, w: a @ w.t())
    assert not cpu_dense.supports(x.double(), w13.double(), w2.double(), weights, ids)
