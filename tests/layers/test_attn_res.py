"""Block AttnRes bookkeeping (`BlockAttnRes`) against the definitional form of model-spec §7.2, with stand-in
sub-layers; with a block size of 1 it is Full AttnRes over decoder layers."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.layers.attn_res import AttnResWeights, BlockAttnRes
from tests.models.k3_reference import block_attn_res, full_attn_res

EPS = 1e-5


def stand_in_layers(num_layers: int, d: int, gen: torch.Generator):
    """Deterministic nonlinear mixers/FFNs and random pseudo-queries (fp64)."""
    def sublayer():
        w = torch.randn(d, d, generator=gen, dtype=torch.float64) * 1.5 / math.sqrt(d)
        return lambda x: torch.tanh(x @ w) * 2

    def weights():
        m = AttnResWeights(d, torch.float64)
        m.norm.copy_(1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64))
        m.proj.copy_(torch.randn(1, d, generator=gen, dtype=torch.float64) * 1.5 / math.sqrt(d))
        return m

    return [(sublayer(), sublayer(), weights(), weights()) for _ in range(num_layers)], weights()


def run_block_attn_res(emb, layers, out_w, block_size):
    res = BlockAttnRes(emb, block_size, len(layers), EPS)
    for i, (mixer, ffn, attn_w, mlp_w) in enumerate(layers):
        res.add(mixer(res.layer_input(i, attn_w)))
        res.add(ffn(res.mix(mlp_w)))
    return res.mix(out_w), res


@pytest.mark.parametrize("num_layers, block_size", [(7, 3), (6, 3), (5, 2), (4, 12), (9, 4)],
                         ids=["7-by-3", "6-by-3", "5-by-2", "one-block", "9-by-4"])
def test_block_attn_res_matches_definition(num_layers: int, block_size: int) -> None:
    """The incremental snapshots + partial equal sources rebuilt from every layer's outputs (fp64)."""
    gen = torch.Generator().manual_seed(num_layers * 10 + block_size)
    d, T = 16, 5
    layers, out_w = stand_in_layers(num_layers, d, gen)
    emb = torch.randn(T, d, generator=gen, dtype=torch.float64)
    out, res = run_block_attn_res(emb, layers, out_w, block_size)
    as_tuples = [(m, f, (a.norm, a.proj), (b.norm, b.proj)) for m, f, a, b in layers]
    ref = block_attn_res(emb, as_tuples, (out_w.norm, out_w.proj), block_size, EPS)
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert res.num_blocks == math.ceil(num_layers / block_size)  # the embedding + every block boundary


def test_block_size_one_is_full_attn_res() -> None:
    """attn_res_block_size = 1: every earlier decoder layer's output is its own source (Full AttnRes)."""
    gen = torch.Generator().manual_seed(1)
    d, T, num_layers = 16, 4, 6
    layers, out_w = stand_in_layers(num_layers, d, gen)
    emb = torch.randn(T, d, generator=gen, dtype=torch.float64)
    out, _ = run_block_attn_res(emb, layers, out_w, 1)
    as_tuples = [(m, f, (a.norm, a.proj), (b.norm, b.proj)) for m, f, a, b in layers]
    ref = full_attn_res(emb, as_tuples, (out_w.norm, out_w.proj), EPS)
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()


def test_block_attn_res_checkpoint_names() -> None:
    """One mix loads `{prefix}_norm.weight` [d] and `{prefix}_proj.weight` [1, d] (model-spec §9.2)."""
    names = {k: tuple(v.shape) for k, v in AttnResWeights(8, torch.float32).checkpoint_tensors("mlp_res").items()}
    assert names == {"mlp_res_norm.weight": (8,), "mlp_res_proj.weight": (1, 8)}
