"""Parity of the `sdpa` backend of mla_prefill (deltaserve.ops.mla.sdpa: PyTorch's CPU flash-attention kernel over
pieces of the paged context) with the reference, and its dispatch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import dispatch
from deltaserve.ops.mla import ref, sdpa
from tests.ops.test_mla import (
    HEADS,
    NOPE,
    ROPE,
    SCALE,
    V_DIM,
    PagedCache,
    assert_close,
    cu_of,
    dense_mla,
    random_problem,
    split_kv_b,
    write_all,
)

pytestmark = pytest.mark.skipif(not sdpa.available(), reason="this torch has no CPU flash-attention op")

# Full prompts and last chunks after a cached prefix; single tokens with and without context; lengths and prefixes
# on and off block boundaries (block sizes 4 and 16); one sequence with no queries in this step.
LENGTHS = [1, 5, 16, 17, 33, 64, 9, 40]
FIRST = [0, 4, 0, 16, 7, 63, 9, 12]
BLOCK_SIZES = [pytest.param(4, id="block4"), pytest.param(16, id="block16")]


pytestmark = pytest.mark.usefixtures("default_dispatch")


def chunk_problem(
    lengths: list[int], first: list[int], block_size: int, dtype: torch.dtype, seed: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """mla_prefill arguments (queries of positions first[i]..lengths[i]-1, the whole context cached in a shuffled
    NaN-filled paged cache) in ``dtype``, and the dense fp64 expected output."""
    g = torch.Generator().manual_seed(seed)
    latents, queries, kv_b = random_problem(g, lengths)
    latents, queries, kv_b = [x.to(dtype) for x in latents], [q.to(dtype) for q in queries], kv_b.to(dtype)
    cache = PagedCache(g, lengths, block_size, dtype)
    write_all(cache, latents, lengths)
    q = torch.cat([qs[a:] for qs, a in zip(queries, first, strict=True)])
    chunks = [n - a for n, a in zip(lengths, first, strict=True)]
    args = (q, cache.kv_cache, cache.block_tables, cu_of(chunks), torch.tensor(lengths), *split_kv_b(kv_b))
    dense = torch.cat([dense_mla(qs[a:], lat, kv_b) for qs, lat, a in zip(queries, latents, first, strict=True)])
    return args, dense


def run_sdpa(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sdpa.mla_prefill_sdpa(*args, scale=SCALE)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mla_prefill_sdpa(block_size: int) -> None:
    """fp32 varlen chunks over cached prefixes == the reference and dense attention (README tolerance 1e-5)."""
    args, dense = chunk_problem(LENGTHS, FIRST, block_size, torch.float32, seed=21)
    out = run_sdpa(args)
    assert out.dtype == torch.float32 and out.shape == (args[0].shape[0], HEADS, V_DIM)
    assert_close("sdpa_vs_ref", ref.mla_prefill(*args, scale=SCALE), out, 1e-5)
    assert_close("sdpa_vs_dense", dense, out, 1e-5)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mla_prefill_sdpa_bf16(block_size: int) -> None:
    """bf16: the kernel's fp32 softmax and bf16 scores and values stay within bf16 rounding of the reference (seen:
    about 4e-3 relative, the size of one bf16 rounding, 2**-8) and of dense fp64 attention on the same bf16 inputs."""
    args, dense = chunk_problem(LENGTHS, FIRST, block_size, torch.bfloat16, seed=22)
    out = run_sdpa(args)
    assert out.dtype == torch.bfloat16
    assert_close("sdpa_bf16_vs_ref", ref.mla_prefill(*args, scale=SCALE).double(), out.double(), 2e-2)
    assert_close("sdpa_bf16_vs_dense", dense, out.double(), 2e-2)


@pytest.fixture
def expansions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(sequences, positions) of every expansion of cached latents to keys and values the backend makes."""
    seen: list[tuple[int, int]] = []
    expand = sdpa._Expansion.__call__

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        k, v = expand(self, *args, **kwargs)
        seen.append((k.shape[0], k.shape[1]))
        return k, v

    monkeypatch.setattr(sdpa._Expansion, "__call__", spy)
    return seen


def test_mla_prefill_sdpa_groups_short_contexts(expansions: list[tuple[int, int]]) -> None:
    """Short contexts are expanded in one GEMM for the whole batch (the sequences with queries, up to the longest
    context), not once per sequence."""
    args, _ = chunk_problem(LENGTHS, FIRST, 4, torch.float32, seed=27)
    run_sdpa(args)
    assert expansions == [(len(LENGTHS) - 1, max(LENGTHS))]


@pytest.mark.parametrize("rows", [7, 40])
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_mla_prefill_sdpa_pieces(monkeypatch: pytest.MonkeyPatch, expansions: list[tuple[int, int]], rows: int,
                                 dtype: torch.dtype, rtol: float) -> None:
    """With a bound of 7 or 40 expanded rows (off the 4-row blocks): groups of whole prompts and chunks, and long
    contexts in pieces (prefixes split, chunks split into causal and visible parts) merged by their logsumexps, give
    the reference's output; no expansion exceeds the bound."""
    monkeypatch.setattr(sdpa, "_PIECE_ELEMS", rows * 2 * HEADS * (NOPE + ROPE))
    args, _ = chunk_problem(LENGTHS, FIRST, 4, dtype, seed=23)
    out = run_sdpa(args)
    assert_close("sdpa_pieces_vs_ref", ref.mla_prefill(*args, scale=SCALE).double(), out.double(), rtol)
    assert max(n * p for n, p in expansions) == rows
    assert len(expansions) >= -(-max(LENGTHS) // rows)  # the longest context alone needs that many pieces


def test_mla_prefill_sdpa_long_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3,000-token prompt and a 700-token chunk after 2,300 cached tokens, in one piece and in pieces of 500 rows,
    == the reference."""
    args, _ = chunk_problem([3000, 3000], [0, 2300], 16, torch.float32, seed=24)
    expected = ref.mla_prefill(*args, scale=SCALE)
    assert_close("sdpa_long_vs_ref", expected, run_sdpa(args), 1e-5)
    monkeypatch.setattr(sdpa, "_PIECE_ELEMS", 500 * 2 * HEADS * (NOPE + ROPE))
    assert_close("sdpa_long_pieces_vs_ref", expected, run_sdpa(args), 1e-5)


def test_mla_prefill_sdpa_runs_the_flash_kernel() -> None:
    """The call goes through the flash kernel (which tiles scores) and never through a softmax over a score matrix
    (the math fallback), for fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        args, _ = chunk_problem([40, 33], [0, 20], 16, dtype, seed=25)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_sdpa(args)
        names = {event.name for event in prof.events()}
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
        assert not {"aten::_softmax", "aten::softmax", "aten::_scaled_dot_product_attention_math"} & names


def test_mla_prefill_dispatch_selects_sdpa_on_cpu() -> None:
    """On a CPU, fp32 and bf16 prefills take the sdpa backend (and give its output); fp64 stays on the reference."""
    from deltaserve.ops.mla import mla_prefill

    op = dispatch.get("mla_prefill")
    for dtype, expected in ((torch.float32, "sdpa"), (torch.bfloat16, "sdpa"), (torch.float64, dispatch.REF)):
        args, _ = chunk_problem([9, 5], [3, 0], 4, dtype, seed=26)
        assert op.select(*args, scale=SCALE) == expected
    args, _ = chunk_problem([9, 5], [3, 0], 4, torch.float32, seed=26)
    assert torch.equal(mla_prefill(*args, scale=SCALE), run_sdpa(args))
