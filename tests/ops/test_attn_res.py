"""The Block AttnRes mix (model-spec §7.2) against the formula evaluated token by token, source by source."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops.attn_res import attn_res_mix


def mix_by_hand(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """For each token t: logit_j = sum_c rows_j[c] * rsqrt(mean(rows_j^2) + eps) * norm_w[c] * proj_w[0, c];
    out = sum_j softmax_j(logit) rows_j. Python loops, fp64."""
    T, d = sources[0].shape
    out = torch.empty(T, d, dtype=torch.float64)
    for t in range(T):
        rows = [s[t].double() for s in sources]
        logits = []
        for r in rows:
            rms = math.sqrt(sum(v * v for v in r.tolist()) / d + eps)
            logits.append(sum((r[c] / rms * norm_w[c] * proj_w[0, c]).item() for c in range(d)))
        m = max(logits)
        weights = [math.exp(z - m) for z in logits]
        total = sum(weights)
        out[t] = sum(w / total * r for w, r in zip(weights, rows, strict=True))
    return out


@pytest.mark.parametrize("num_blocks, with_partial", [(0, True), (1, True), (4, True), (3, False)],
                         ids=["partial-only", "1-block", "4-blocks", "no-partial"])
def test_attn_res_mix_matches_formula(num_blocks: int, with_partial: bool) -> None:
    """fp64 mix equals the per-token, per-source evaluation of the spec formula."""
    g = torch.Generator().manual_seed(0)
    T, d, eps = 5, 24, 1e-5
    blocks = torch.randn(num_blocks, T, d, generator=g, dtype=torch.float64) * 3
    partial = torch.randn(T, d, generator=g, dtype=torch.float64) if with_partial else None
    norm_w = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    proj_w = torch.randn(1, d, generator=g, dtype=torch.float64) * 1.5 / math.sqrt(d)
    out = attn_res_mix(blocks, partial, norm_w, proj_w, eps)
    ref = mix_by_hand(list(blocks.unbind(0)) + ([partial] if with_partial else []), norm_w, proj_w, eps)
    assert out.dtype == torch.float64
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    if num_blocks + with_partial == 1:
        assert torch.equal(out, (partial if with_partial else blocks[0]))  # one source: softmax weight exactly 1


def test_attn_res_mix_bf16_runs_in_fp32() -> None:
    """bf16 sources: the math runs in fp32 and only the result is rounded to bf16."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn(3, 7, 64, generator=g).bfloat16()
    partial = torch.randn(7, 64, generator=g).bfloat16()
    norm_w, proj_w = torch.ones(64).bfloat16(), (torch.randn(1, 64, generator=g) / 8).bfloat16()
    out = attn_res_mix(blocks, partial, norm_w, proj_w, 1e-5)
    ref = attn_res_mix(blocks.float(), partial.float(), norm_w.float(), proj_w.float(), 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())


def test_attn_res_mix_needs_a_source() -> None:
    """No blocks and no partial is an error, not an empty result."""
    with pytest.raises(ValueError, match="at least one source"):
        attn_res_mix(torch.zeros(0, 2, 4), None, torch.ones(4), torch.ones(1, 4), 1e-5)
