"""The dense linear op: oneDNN-packed weights (CPU, bf16) against `F.linear`, and whole models after prepacking; the
native few-row kernel and the bf16-as-fp32 GEMM against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.linear import prepack_weights
from deltaserve.models.loader import load_model
from deltaserve.ops import dispatch, native_backend
from deltaserve.ops.linear import can_pack, linear, native, onednn, pack, ref
from tests.helpers import full_logits, prompt_ids

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="no oneDNN bf16 linear in this torch on this CPU")
needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels here")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 300])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (1056, 1024), (40, 72)])
def test_packed_linear_matches_f_linear(rows, out_features, in_features):
    """A packed bf16 weight gives F.linear's numbers (oneDNN serves both; seen bit-identical), for any row count."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    assert linear.select(x, packed) == "onednn"  # type: ignore[attr-defined]
    out = linear(x, packed)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w), rtol=0, atol=0)


@needs_onednn
def test_packed_linear_takes_strided_and_batched_inputs():
    """Inputs that are column slices of a wider tensor (a fused projection's split) or have leading dims work."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).bfloat16()
    wide = torch.randn(5, 80, generator=g).bfloat16()
    x = wide[:, 16:48]  # not contiguous
    torch.testing.assert_close(linear(x, pack(w)), F.linear(x, w), rtol=0, atol=0)
    x3 = torch.randn(2, 3, 32, generator=g).bfloat16()
    torch.testing.assert_close(linear(x3, pack(w)), F.linear(x3, w), rtol=0, atol=0)


@needs_onednn
def test_reference_unpacks_and_plain_weights_take_the_reference():
    """The reference (the oracle) accepts a packed weight; a plain weight never goes to the oneDNN backend."""
    w = torch.randn(16, 8).bfloat16()
    x = torch.randn(2, 8).bfloat16()
    assert torch.equal(ref.linear(x, pack(w)), F.linear(x, w))
    assert linear.select(x, w) != "onednn"  # type: ignore[attr-defined]
    assert linear.select(x.float(), pack(w)) == "ref"  # type: ignore[attr-defined]  # dtype mismatch


def test_only_bf16_cpu_matrices_are_packed():
    """fp32 stays plain (oneDNN's one-row GEMM read fp32 weights ~15% slower than MKL's here), as do fp64, vectors
    and stacks; `pack` refuses what `can_pack` refuses, naming it."""
    assert not can_pack(torch.zeros(4, 4)) and not can_pack(torch.zeros(4, 4, dtype=torch.float64))
    assert not can_pack(torch.zeros(4).bfloat16()) and not can_pack(torch.zeros(2, 4, 4).bfloat16())
    assert can_pack(torch.zeros(4, 4).bfloat16()) == onednn.available()
    with pytest.raises(ValueError, match="float32"):
        pack(torch.zeros(4, 4))


@needs_onednn
@pytest.mark.parametrize("variant", ["base", "qlora-2shared-bsmoe", "odd-sizes", "k3"])
def test_prepacked_model_gives_the_same_logits(tiny_dir, variant, default_dispatch):
    """A bf16 model after `prepack_weights` computes the logits of the unpacked model exactly: every linear, the
    per-expert packed MoE stacks (looped over the experts with tokens) and the LM head; MLA's `kv_b` (read directly)
    and MXFP4 experts stay as loaded. Both MoEs loop over the experts (the plain stacks would otherwise take the
    every-expert `cpu_dense` path under these 40 tokens: other numbers, by design)."""
    default_dispatch.setenv("DELTASERVE_OPS_BACKEND", "moe_experts=ref")
    dispatch.reset()
    path = tiny_dir(variant)
    ids = prompt_ids(700, 40, seed=1)
    plain = load_model(path, dtype=torch.bfloat16)
    packed = load_model(path, dtype=torch.bfloat16)
    count = prepack_weights(packed)
    assert count > 0
    layer = packed.layers[-1]
    assert layer.self_attn.in_proj.weight.is_mkldnn
    if hasattr(layer.self_attn, "kv_b_proj"):
        assert not layer.self_attn.kv_b_proj.weight.is_mkldnn
    if not packed.config.tie_word_embeddings:
        assert packed.lm_head.is_mkldnn
    assert not packed.embed_tokens.is_mkldnn
    assert torch.equal(full_logits(packed, ids), full_logits(plain, ids))


@needs_onednn
def test_prepack_leaves_fp32_models_alone(tiny_dir):
    """Nothing is packed in an fp32 model, so its numbers (the transformers parity) cannot move."""
    assert prepack_weights(load_model(tiny_dir("base"))) == 0


def _close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`out` within the linear's tolerance of the exact product (fp64) rounded to x's dtype: fp32 1e-5 relative to
    the row's scale; bf16 one bf16 step (the fp32 sum can land on the other side of a rounding boundary)."""
    exact = F.linear(x.double(), w.double())
    scale = exact.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    if x.dtype == torch.float32:
        assert ((out.double() - exact).abs() / scale).max() < 1e-5
    else:
        step = exact.to(torch.bfloat16).double().abs().clamp_min(2.0**-100) * 2.0**-7
        assert ((out.double() - exact).abs() <= step).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 4100, 160), (2, 64, 1024), (5, 7, 24),
                                                             (8, 1027, 512), (16, 33, 1032)])
def test_native_linear_matches_f_linear(rows, out_features, in_features, dtype, default_dispatch):
    """The C kernel on any output count (partial tiles), inputs in blocks and whole, 1-16 rows: within the
    tolerance of the exact product."""
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    out = native.kernel_linear(x, w)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    _close(out, x, w)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_linear_row_alone_equals_batched_on_any_thread_count(dtype):
    """A row's bits do not depend on the other rows (decode batch == alone, a verify chunk == its decode steps) nor
    on the thread count; leading dims and a column-slice input (a fused projection's split) work."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1029, 256, generator=g).to(dtype)
    wide = torch.randn(16, 300, generator=g).to(dtype)
    x = wide[:, 20:276]  # not contiguous
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [native.kernel_linear(x[i:i + 1], w) for i in range(16)]
        torch.set_num_threads(2)
        batched = native.kernel_linear(x, w)
        three = native.kernel_linear(x[:12].reshape(3, 4, 256), w)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(batched[i:i + 1], alone[i]) for i in range(16))
    assert torch.equal(three.reshape(12, -1), batched[:12])


@needs_native
def test_native_linear_takes_only_what_it_computes():
    """The dispatcher gives the backend 1-16 rows of a large fp32 weight (one that does not stay in the caches) and
    bf16 calls on CPUs without a bf16 path; small fp32 weights, more fp32 rows, fp64, a dtype mismatch and a
    non-contiguous fp32 weight take the reference. The kernel computes at most 16 rows of a multiple of 8 inputs of a
    plain contiguous weight, and refuses a bad shape before writing anything."""
    big, small = torch.randn(1024, 1024), torch.randn(16, 64)
    assert linear.select(torch.randn(1, 1024), big) == "native"  # type: ignore[attr-defined]
    assert linear.select(torch.randn(16, 1024), big) == "native"  # type: ignore[attr-defined]
    bf16 = "ref" if onednn.available() else "native"  # bf16 only where the CPU has no bf16 path
    assert linear.select(torch.randn(2, 64).bfloat16(), small.bfloat16()) == bf16  # type: ignore[attr-defined]
    assert linear.select(torch.randn(8, 64), small) == "ref"  # type: ignore[attr-defined]
    assert linear.select(torch.randn(17, 1024), big) == "ref"  # type: ignore[attr-defined]
    assert linear.select(torch.randn(2, 1024).double(), big.double()) == "ref"  # type: ignore[attr-defined]
    assert linear.select(torch.randn(2, 1024), big.bfloat16()) == "ref"  # type: ignore[attr-defined]
    assert linear.select(torch.randn(2, 1024), big.t()) == "ref"  # type: ignore[attr-defined]
    assert native._kernel_takes(torch.randn(16, 64).bfloat16(), small.bfloat16())
    assert not native._kernel_takes(torch.randn(17, 64).bfloat16(), small.bfloat16())
    assert not native._kernel_takes(torch.randn(2, 60).bfloat16(), torch.randn(16, 60).bfloat16())
    assert not native._kernel_takes(torch.randn(0, 1024), big)
    with pytest.raises(ValueError, match="17 rows of 64"):
        native.kernel_linear(torch.randn(17, 64), small)


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_bf16_gemm_runs_as_fp32_where_the_cpu_has_no_bf16_path(rows, default_dispatch):
    """bf16 calls the kernel does not take (more than 16 rows; one row of a small weight) run as an fp32 GEMM
    (widened, one rounding) on CPUs whose oneDNN has no bf16 path (there PyTorch's bf16 GEMM runs at about a tenth of
    the fp32 rate), else as `F.linear`; within one bf16 step."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 72, generator=g).bfloat16()
    x = torch.randn(rows, 72, generator=g).bfloat16()
    _close(native.upcast_linear(x, w), x, w)
    if native.available():
        assert linear.select(x, w) == ("ref" if onednn.available() else "native")  # type: ignore[attr-defined]
        _close(native.linear(x, w), x, w)
    assert linear.select(x.float(), w.float()) == "ref"  # type: ignore[attr-defined]


def test_switched_off_native_kernels_leave_f_linear(monkeypatch, default_dispatch):
    """`DELTASERVE_NATIVE_KERNELS=0`: a few fp32 rows take the reference again."""
    monkeypatch.setenv("DELTASERVE_NATIVE_KERNELS", "0")
    native_backend.load.cache_clear()
    dispatch.reset()
    try:
        assert linear.select(torch.randn(2, 1024), torch.randn(1024, 1024)) == "ref"  # type: ignore[attr-defined]
    finally:
        native_backend.load.cache_clear()
        monkeypatch.delenv("DELTASERVE_NATIVE_KERNELS")
        dispatch.reset()
