"""MLA over contexts longer than one attention step: the prefill walks the context in blocks and the queries in tiles
with an online softmax, the decode walks the context in blocks; both must equal dense attention (spec §4)."""

from __future__ import annotations

import torch

from deltaserve.ops.mla import mla_decode
from deltaserve.ops.mla.ref import _CONTEXT_ROWS, _TILE_ELEMS
from tests.ops.test_mla import (
    HEADS,
    RANK,
    ROPE,
    SCALE,
    PagedCache,
    absorbed_decode,
    assert_close,
    cu_of,
    dense_mla,
    prefill,
    random_problem,
    write_all,
)

# Two sequences: one prefilled whole, one whose last chunk follows a cached prefix. Long enough for three context
# steps, and with queries enough for several query tiles.
LENGTHS = [2 * _CONTEXT_ROWS + 300, _CONTEXT_ROWS + 5]
FIRST = [0, 40]


def test_constants_make_this_test_tile() -> None:
    """The problem below spans several context steps and several query tiles at the module's own sizes."""
    assert max(LENGTHS) > 2 * _CONTEXT_ROWS
    assert max(n - a for n, a in zip(LENGTHS, FIRST, strict=True)) > _TILE_ELEMS // (2 * HEADS * _CONTEXT_ROWS)


def test_mla_prefill_long_context_tiles() -> None:
    """Chunks over a multi-block context, with a padded varlen batch and a cached prefix, == dense causal MLA."""
    g = torch.Generator().manual_seed(11)
    latents, queries, kv_b = random_problem(g, LENGTHS)
    cache = PagedCache(g, LENGTHS, 16, torch.float32)
    write_all(cache, latents, LENGTHS)
    chunks = [n - a for n, a in zip(LENGTHS, FIRST, strict=True)]
    out = prefill(torch.cat([q[a:] for q, a in zip(queries, FIRST, strict=True)]), cache, cu_of(chunks),
                  torch.tensor(LENGTHS), kv_b)
    ref = torch.cat([dense_mla(q[a:], lat, kv_b) for q, lat, a in zip(queries, latents, FIRST, strict=True)])
    assert out.dtype == torch.float32
    assert_close("mla_prefill_long", ref, out, 1e-5)


def test_mla_prefill_long_context_fp64() -> None:
    """In fp64 the tiled online softmax is the dense softmax to fp64 rounding."""
    g = torch.Generator().manual_seed(12)
    latents, queries, kv_b = random_problem(g, LENGTHS)
    latents, queries, kv_b = [x.double() for x in latents], [q.double() for q in queries], kv_b.double()
    cache = PagedCache(g, LENGTHS, 16, torch.float64)
    write_all(cache, latents, LENGTHS)
    out = prefill(torch.cat(queries), cache, cu_of(LENGTHS), torch.tensor(LENGTHS), kv_b)
    ref = torch.cat([dense_mla(q, lat, kv_b) for q, lat in zip(queries, latents, strict=True)])
    assert out.dtype == torch.float64
    assert_close("mla_prefill_long_fp64", ref, out, 1e-12)


def test_mla_decode_long_context() -> None:
    """Absorbed decode over a context of several blocks (one sequence ends mid-block) == dense attention."""
    g = torch.Generator().manual_seed(13)
    lengths = [_TILE_ELEMS // (2 * (RANK + ROPE)) + 700, 33]  # more rows than one decode step reads
    latents, queries, kv_b = random_problem(g, lengths)
    cache = PagedCache(g, lengths, 16, torch.float32)
    write_all(cache, latents, lengths)
    q = torch.stack([qs[-1] for qs in queries])
    out = absorbed_decode(q, cache, torch.tensor(lengths), kv_b)
    ref = torch.stack([dense_mla(qs[-1:], lat, kv_b)[0] for qs, lat in zip(queries, latents, strict=True)])
    assert_close("mla_decode_long", ref, out.double(), 1e-5)
    latent_out = mla_decode(torch.randn(2, HEADS, latents[0].shape[1], generator=g), cache.kv_cache,
                            cache.block_tables, torch.tensor(lengths), kv_lora_rank=RANK, scale=SCALE)
    assert torch.isfinite(latent_out).all()  # NaN-filled spare blocks and rows past a context never leak
