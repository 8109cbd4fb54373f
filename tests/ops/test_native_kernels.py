"""The CPU's C kernels (`ops/kda/native.c`, `ops/short_conv/native.c`, `ops/moe/native.c`) against the references,
and the verify ops (`kda_verify`, `short_conv_verify`) against their decode ops token by token, bit for bit, on every
backend the decode op can take here: what makes speculative verification exact."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve.ops import dispatch, native_backend
from deltaserve.ops.kda import kda_decode, kda_gate, kda_verify
from deltaserve.ops.kda import native as kda_native
from deltaserve.ops.kda import ref as kda_ref
from deltaserve.ops.short_conv import native as conv_native
from deltaserve.ops.short_conv import ref as conv_ref
from deltaserve.ops.short_conv import short_conv_decode, short_conv_verify
from deltaserve.ops.stepwise_verify import verify_stepwise

pytestmark = pytest.mark.usefixtures("default_dispatch")
needs_native = pytest.mark.skipif(not native_backend.available() or not kda_native.available(),
                                  reason="no C compiler here: the native kernels are not built")

H, K, CHANNELS, WIDTH = 3, 20, 37, 4  # odd sizes: vector loops with remainders


def kda_inputs(n: int, dtype: torch.dtype, seed: int, steep: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, K, generator=g).to(dtype) for _ in range(3))
    f = torch.randn(n, H, K, generator=g) * (3.0 if steep else 1.0)
    gate = kda_gate(f, torch.randn(1, 1, H, 1, generator=g), torch.randn(H * K, generator=g), -5.0 if steep else None)
    return q, k, v, gate, torch.rand(n, H, generator=g).to(dtype)


def rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steep", [False, True], ids=["mild", "k3-steep"])
@pytest.mark.parametrize("slots", ["slice", "gathered"])
def test_native_kda_decode_matches_the_reference_over_many_steps(dtype, steep, slots):
    """20 steps of 5 rows from a non-zero state: outputs and states within the fp32 KDA tolerance (1e-5); slots not
    named stay untouched."""
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(13, H, K, K, generator=g) * 0.1
    ours, theirs = pool.clone(), pool.clone()
    index: torch.Tensor | slice = slice(2, 7) if slots == "slice" else torch.tensor([11, 0, 4, 9, 2])
    for step in range(20):
        args = kda_inputs(5, dtype, seed=step, steep=steep)
        out, want = kda_native.kda_decode(*args, ours, index), kda_ref.kda_decode(*args, theirs, index)
        assert out.dtype == want.dtype == dtype
        assert rel(out, want) < (1e-5 if dtype == torch.float32 else 1e-2), step
    assert rel(ours, theirs) < 1e-5
    used = set(range(2, 7)) if slots == "slice" else {11, 0, 4, 9, 2}
    for s in set(range(13)) - used:
        assert torch.equal(ours[s], pool[s])


@needs_native
@pytest.mark.parametrize("x_dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "k3"])
def test_native_short_conv_decode_matches_the_reference(x_dtype, pool_dtype):
    """Outputs within the conv tolerance and windows equal to the reference's, over many steps; K3's case is bf16
    inputs with an fp32 weight and pool."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(CHANNELS, WIDTH, generator=g) * 0.7).to(pool_dtype)
    pool = torch.randn(6, CHANNELS, WIDTH - 1, generator=g).to(pool_dtype)
    ours, theirs = pool.clone(), pool.clone()
    slots = torch.tensor([4, 1])
    for step in range(12):
        x = torch.randn(2, CHANNELS, generator=g).to(x_dtype)
        out, want = conv_native.short_conv_decode(x, weight, ours, slots), conv_ref.short_conv_decode(
            x, weight, theirs, slots)
        assert out.dtype == want.dtype == x_dtype
        assert rel(out, want) < (1e-5 if x_dtype == torch.float32 else 1e-2), step
        assert torch.equal(ours, theirs), step
    assert not conv_native.supports(torch.zeros(1, 3), torch.zeros(3, 4, dtype=torch.bfloat16),
                                    torch.zeros(1, 3, 3))  # fp32 inputs are not exact in a bf16 weight
    with pytest.raises(ValueError, match="activation"):
        conv_native.short_conv_decode(x, weight, ours, slots, activation="gelu")
    assert torch.equal(ours, theirs)  # refused before the pool was touched


def chunks(lens: list[int]) -> tuple[list[int], list[tuple[int, ...]], torch.Tensor]:
    """Offsets, scratch slots (one fewer than the chunk's tokens; chunk i's from 20 + 10 i) and the chunks' slots."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    scratch = [tuple(range(20 + 10 * i, 20 + 10 * i + n - 1)) for i, n in enumerate(lens)]
    return cu, scratch, torch.tensor([3, 0, 7, 5, 9][:len(lens)])


BACKENDS = ["native", "cpu", "ref"]
LENS = [[8], [4, 4, 4], [3, 8, 1, 5], [1, 1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens", LENS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_verify_is_the_decode_token_by_token_bit_for_bit(default_dispatch, backend, lens, dtype):
    """Whatever backend `kda_decode` takes (forced here), `kda_verify` gives the outputs, final states and scratch
    states of calling it once per token, exactly; chunks of unequal lengths included."""
    if backend == "native" and not kda_native.available():
        pytest.skip("no C compiler here")
    default_dispatch.setenv("DELTASERVE_OPS_BACKEND", f"kda_decode={backend}")
    dispatch.reset()
    cu, scratch, slots = chunks(lens)
    q, k, v, gate, beta = kda_inputs(cu[-1], dtype, seed=len(lens))
    pool = torch.randn(60, H, K, K, generator=torch.Generator().manual_seed(1)) * 0.1
    ours, theirs = pool.clone(), pool.clone()
    out = kda_verify(q, k, v, gate, beta, ours, slots, cu, scratch)
    want = verify_stepwise(lambda r, s: kda_decode(q[r], k[r], v[r], gate[r], beta[r], theirs, s), cu[-1], theirs,
                           slots, cu, scratch)
    assert torch.equal(out, want)
    assert torch.equal(ours, theirs)
    assert max(lens) == 1 or not torch.equal(ours[20], pool[20])  # a scratch state was written


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens", LENS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_verify_is_the_decode_token_by_token_bit_for_bit(default_dispatch, backend, lens, dtype):
    """The same for `short_conv_verify` against `short_conv_decode`: outputs, windows and scratch windows. The
    PyTorch backends' SiLU takes a vector path and a scalar one for the remainder that differ in the last bit, so
    with them rows are exact only where the channels are a multiple of the vector width (every checkpoint's 3 H Dh);
    the C kernel takes one path for every element (an odd width here)."""
    if backend == "native" and not conv_native.available():
        pytest.skip("no C compiler here")
    channels = CHANNELS if backend == "native" else 64
    default_dispatch.setenv("DELTASERVE_OPS_BACKEND", f"short_conv_decode={backend}")
    dispatch.reset()
    cu, scratch, slots = chunks(lens)
    g = torch.Generator().manual_seed(len(lens))
    x = torch.randn(cu[-1], channels, generator=g).to(dtype)
    weight = torch.randn(channels, WIDTH, generator=g).to(dtype)
    pool = torch.randn(60, channels, WIDTH - 1, generator=g).to(dtype)
    ours, theirs = pool.clone(), pool.clone()
    out = short_conv_verify(x, weight, ours, slots, cu, scratch)
    want = verify_stepwise(lambda r, s: short_conv_decode(x[r], weight, theirs, s), cu[-1], theirs, slots, cu,
                           scratch)
    assert torch.equal(out, want)
    assert torch.equal(ours, theirs)
    assert max(lens) == 1 or not torch.equal(ours[20], pool[20])


@needs_native
def test_a_row_gets_the_same_bits_alone_or_batched_on_any_thread_count():
    """The C kernel's per-(row, head) arithmetic does not depend on the batch or on the threads it runs on."""
    q, k, v, gate, beta = kda_inputs(9, torch.float32, seed=4)
    pool = torch.randn(12, H, K, K, generator=torch.Generator().manual_seed(2)) * 0.1
    alone_pool, batch_pool = pool.clone(), pool.clone()
    alone = kda_native.kda_decode(q[4:5], k[4:5], v[4:5], gate[4:5], beta[4:5], alone_pool, torch.tensor([4]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = kda_native.kda_decode(q, k, v, gate, beta, batch_pool, slice(0, 9))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batched[4])
    assert torch.equal(alone_pool[4], batch_pool[4])


def test_no_compiler_or_switched_off_leaves_the_pytorch_backends(monkeypatch, tmp_path, caplog):
    """`DELTASERVE_NATIVE_KERNELS=0` makes the kernels unavailable; a failing build is logged once and the library is
    None (its ops then resolve to their PyTorch backends); nothing is left in the cache."""
    monkeypatch.setenv("DELTASERVE_NATIVE_KERNELS", "0")
    assert not native_backend.available()
    monkeypatch.delenv("DELTASERVE_NATIVE_KERNELS")
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    monkeypatch.setenv("DELTASERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    if native_backend.compiler() is None:
        pytest.skip("no C compiler here")
    with caplog.at_level(logging.WARNING, logger="deltaserve.ops.native_backend"):
        assert native_backend.load(str(source)) is None
    assert "broken.c not built" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


@needs_native
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written():
    """The kernels check every slot (the chunks' and the scratch ones) against the pool first: an IndexError naming
    the pool, as torch's indexing would raise, and the pool untouched (no write out of bounds, none in bounds)."""
    q, k, v, gate, beta = kda_inputs(2, torch.float32, seed=9)
    pool = torch.randn(4, H, K, K)
    before = pool.clone()
    with pytest.raises(IndexError, match="4 slots"):
        kda_native.kda_decode(q, k, v, gate, beta, pool, torch.tensor([1, 4]))
    with pytest.raises(IndexError, match="4 slots"):
        kda_native.kda_verify(q, k, v, gate, beta, pool, torch.tensor([1]), [0, 2], [(7,)])
    assert torch.equal(pool, before)
    x, weight, windows = torch.randn(2, CHANNELS), torch.randn(CHANNELS, WIDTH), torch.randn(3, CHANNELS, WIDTH - 1)
    original = windows.clone()
    with pytest.raises(IndexError, match="3 slots"):
        conv_native.short_conv_decode(x, weight, windows, torch.tensor([0, -1]))
    with pytest.raises(IndexError, match="3 slots"):
        conv_native.short_conv_verify(x, weight, windows, torch.tensor([0]), [0, 2], [(3,)])
    assert torch.equal(windows, original)


def moe_inputs(tokens: int, dtype: torch.dtype, seed: int, d: int = 37, i: int = 23, experts: int = 6, top_k: int = 2
               ) -> tuple[torch.Tensor, ...]:
    """Odd hidden and intermediate sizes (the dot products' 8-lane loops with remainders), routed top-k ids."""
    from deltaserve.ops.moe.ref import moe_route

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * i, d, generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(experts, d, i, generator=g) / i**0.5).to(dtype)
    weights, ids = moe_route(torch.randn(tokens, experts, generator=g), None, top_k=top_k, num_expert_group=1,
                             topk_group=1, renormalize=True, routed_scaling_factor=2.5)
    return x, w13, w2, weights, ids


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp32_combine", [False, True], ids=["combine-in-dtype", "fp32-combine"])
def test_native_moe_experts_match_the_reference(dtype, fp32_combine):
    """A few tokens through the C kernel == the reference loop within the MoE tolerance (fp32 1e-6; bf16 1e-2, the
    kernel keeps every rounding of the reference), a pair another expert-parallel rank holds (-1) included; and a
    token's output has the same bits alone or batched, on one thread or two (what verification needs)."""
    from deltaserve.ops.moe import native as moe_native
    from deltaserve.ops.moe.ref import moe_experts

    for seed, tokens in enumerate((1, 3, 8)):
        x, w13, w2, weights, ids = moe_inputs(tokens, dtype, seed)
        if tokens > 1:
            ids[1, 0] = -1
        assert moe_native.supports(x, w13, w2, weights, ids, fp32_combine=fp32_combine)
        want = moe_experts(x, w13, w2, weights, ids, fp32_combine=fp32_combine)
        got = moe_native.moe_experts_native(x, w13, w2, weights, ids, fp32_combine=fp32_combine)
        assert got.dtype == dtype and got.shape == want.shape
        assert rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2), (seed, rel(got, want))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            two = moe_native.moe_experts_native(x, w13, w2, weights, ids, fp32_combine=fp32_combine)
        finally:
            torch.set_num_threads(threads)
        alone = [moe_native.moe_experts_native(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1],
                                               fp32_combine=fp32_combine) for t in range(tokens)]
        assert torch.equal(two, got) and torch.equal(torch.cat(alone), got)


@needs_native
def test_native_moe_experts_take_only_what_they_compute():
    """The dispatcher gives decode-sized calls (at most MAX_PAIRS routed pairs) of dense SiLU-GLU stacks to the C
    kernel, and nothing else: more pairs, K3's SiTU, another linear (MXFP4, packed weights), fp64, non-contiguous
    stacks. An expert id outside the stack is an IndexError before anything runs."""
    import functools

    import torch.nn.functional as F

    from deltaserve.ops.activation import situ_and_mul
    from deltaserve.ops.linear import linear as ops_linear
    from deltaserve.ops.moe import moe_experts as dispatched
    from deltaserve.ops.moe import native as moe_native

    x, w13, w2, weights, ids = moe_inputs(8, torch.float32, seed=5)
    assert dispatched.select(x, w13, w2, weights, ids) == "native"  # type: ignore[attr-defined]
    # the MoE layer passes the dispatched linear on a CPU (the reference then loops through its few-row kernel)
    assert dispatched.select(x, w13, w2, weights, ids, linear=ops_linear) == "native"  # type: ignore[attr-defined]
    more = moe_inputs(9, torch.float32, seed=5)
    assert not moe_native.supports(*more)  # 18 pairs
    situ = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0, interleaved=True)
    assert not moe_native.supports(x, w13, w2, weights, ids, act=situ)
    assert not moe_native.supports(x, w13, w2, weights, ids, linear=lambda a, w: F.linear(a, w))
    assert not moe_native.supports(x.double(), w13.double(), w2.double(), weights, ids)
    assert not moe_native.supports(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    bad = ids.clone()
    bad[0, 0] = 6
    with pytest.raises(IndexError, match=r"outside \[-1, 6\)"):
        moe_native.moe_experts_native(x, w13, w2, weights, bad)
