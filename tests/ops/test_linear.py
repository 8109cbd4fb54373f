"""The dense linear op: oneDNN-packed weights (CPU, bf16) against `F.linear`, and whole models after prepacking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.linear import prepack_weights
from deltaserve.models.loader import load_model
from deltaserve.ops import dispatch
from deltaserve.ops.linear import can_pack, linear, onednn, pack, ref
from tests.helpers import full_logits, prompt_ids

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="no oneDNN bf16 linear in this torch on this CPU")


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
    assert linear.select(x, w) == "ref"  # type: ignore[attr-defined]
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
