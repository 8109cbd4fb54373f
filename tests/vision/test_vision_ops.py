"""The vision ops' references against transformers' Kimi K2.5 building blocks (fp32): the 2D rotary embedding (in
the checkpoint's interleaved layout vs transformers' permuted one), the position-grid resampling, patch merging, and
attention within each image."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_k25 import modeling_kimi_k25 as hf
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
from transformers.vision_utils import get_vision_position_ids

from deltaserve.ops.vision import ref, sdpa

GRIDS = {
    "one": [(1, 4, 6)],
    "several": [(1, 2, 2), (1, 10, 4), (1, 6, 14)],
    "same-as-table": [(1, 8, 8)],
    "larger-than-table": [(1, 20, 12)],
    "clip": [(1, 4, 4), (3, 2, 6)],
}


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out - want).norm() / want.norm())


def _to_half_layout(x: torch.Tensor) -> torch.Tensor:
    """Per head: interleaved (even, odd) pairs -> first halves then second halves (transformers' PermuteForRope)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
def test_apply_rope_2d(grids):
    """Rotating in the interleaved layout, then permuting, equals transformers' rotation of the permuted input."""
    config = Kimi_K25VisionConfig(hidden_size=64, num_attention_heads=4)
    n, heads, head_dim = sum(t * h * w for t, h, w in grids), 4, 16
    x = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = ref.rope_2d_cos_sin(grids, head_dim, 10000.0)
    ours = _to_half_layout(ref.apply_rope_2d(x, cos, sin))
    rotary = hf.Kimi_K25VisionRotaryEmbedding(config)
    hf_cos, hf_sin = rotary(x, get_vision_position_ids(torch.tensor(grids), spatial_merge_size=1))
    half = _to_half_layout(x)[None]
    want, _ = hf.apply_rotary_pos_emb_vision(half, half, hf_cos[None], hf_sin[None])
    assert _rel(ours, want[0]) < 1e-6


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
def test_interpolate_pos_emb(grids):
    """The resampled grid (plus the time embedding of a clip's frames) equals transformers' position embedding."""
    config = Kimi_K25VisionConfig(hidden_size=32, num_attention_heads=4, pos_emb_height=8, pos_emb_width=8)
    module = hf.Kimi_K25VisionPositionEmbeddings(config)
    with torch.no_grad():
        module.position_embeddings.copy_(torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(1)))
        n = sum(t * h * w for t, h, w in grids)
        want = module(torch.zeros(n, 32), torch.tensor(grids))
    ours = ref.interpolate_pos_emb(module.position_embeddings.detach(), grids, ref.time_embedding(4, 32))
    assert _rel(ours, want) < 1e-6


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
def test_merge_patches(grids):
    """2x2 merging (frames averaged) equals transformers' temporal_merge."""
    n = sum(t * h * w for t, h, w in grids)
    x = torch.randn(n, 24, generator=torch.Generator().manual_seed(2))
    want = hf.Kimi_K25VisionModel.temporal_merge(None, x, torch.tensor(grids), 2, 2)
    ours = ref.merge_patches(x, grids, (2, 2))
    assert ours.shape == want.shape
    assert _rel(ours, want) < 1e-6


def test_merge_patches_single_frame_is_a_permutation():
    """For images the merge only reorders: every patch appears once, in 2x2 raster blocks."""
    x = torch.arange(4 * 6, dtype=torch.float32)[:, None]
    merged = ref.merge_patches(x, [(1, 4, 6)], (2, 2))[..., 0]
    assert merged[0].tolist() == [0, 1, 6, 7] and merged[1].tolist() == [2, 3, 8, 9]
    assert sorted(merged.flatten().tolist()) == x.flatten().tolist()


def test_varlen_attention_stays_within_each_image():
    """Each image attends only to itself: equal to attention over each image alone."""
    grids = [(1, 2, 4), (1, 4, 4), (1, 2, 2)]
    bounds = ref.cu_seqlens_of(grids)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bounds[-1], 2, 8, generator=gen) for _ in range(3))
    out = ref.varlen_attention(q, k, v, bounds, 8 ** -0.5)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        assert _rel(out[start:end], alone) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_sdpa(dtype):
    """The SDPA backend equals the reference (fp32: 1e-6; bf16: to bf16 rounding)."""
    grids = [(1, 3, 5), (1, 16, 10), (1, 1, 1)]
    bounds = ref.cu_seqlens_of(grids)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(bounds[-1], 3, 16, generator=gen).to(dtype) for _ in range(3))
    out = sdpa.varlen_attention_sdpa(q, k, v, bounds, 0.25)
    want = ref.varlen_attention(q, k, v, bounds, 0.25)
    assert out.dtype == dtype
    assert _rel(out.float(), want.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
