"""Parity of the `cpu` backend of mla_decode (deltaserve.ops.mla.cpu_decode: gathered cache rows through PyTorch's
CPU flash-attention kernel, long contexts in pieces merged by their logsumexps) with the reference, and its
dispatch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import dispatch
from deltaserve.ops.mla import cpu_decode, mla_decode, ref, sdpa
from tests.ops.test_mla import assert_close

pytestmark = pytest.mark.skipif(not sdpa.available(), reason="this torch has no CPU flash-attention op")

# The embedded model's latent attention: 8 heads over 256 + 32 wide cache rows.
HEADS, RANK, ROPE = 8, 256, 32
SCALE = 96**-0.5
# Context lengths around block boundaries (block size 16) and long enough for several pieces.
MIXED = [1, 15, 16, 17, 300, 2000]


pytestmark = pytest.mark.usefixtures("default_dispatch")


def decode_problem(lengths: list[int], dtype: torch.dtype, seed: int, block_size: int = 16) -> tuple[torch.Tensor, ...]:
    """mla_decode arguments ``(q, kv_cache, block_tables, context_lens)`` in ``dtype``: each sequence's rows in
    shuffled blocks of a cache whose unwritten rows (past each context, spare blocks) are NaN; the table columns past
    a context name a spare block of +inf."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    kv_cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"), dtype=dtype)
    kv_cache[-1] = float("inf")
    perm = torch.randperm(num_blocks - 1, generator=g)  # the +inf block is never a sequence's
    block_tables = torch.full((len(lengths), max(needed) + 1), num_blocks - 1, dtype=torch.int64)
    used = 0
    for i, (n, blocks) in enumerate(zip(lengths, needed, strict=True)):
        block_tables[i, :blocks] = perm[used : used + blocks]
        used += blocks
        pos = torch.arange(n)
        slots = block_tables[i, pos // block_size] * block_size + pos % block_size
        kv_cache.view(-1, RANK + ROPE)[slots] = torch.randn(n, RANK + ROPE, generator=g).to(dtype)
    q = torch.randn(len(lengths), HEADS, RANK + ROPE, generator=g).to(dtype)
    return q, kv_cache, block_tables, torch.tensor(lengths)


def run_ref(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ref.mla_decode(*args, kv_lora_rank=RANK, scale=SCALE)


def run_cpu(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = cpu_decode.mla_decode_cpu(*args, kv_lora_rank=RANK, scale=SCALE)
    assert out.dtype == args[0].dtype and out.shape == (args[0].shape[0], HEADS, RANK)
    return out


def fp64(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same problem in fp64 (the reference's fp64 output is the exact answer for these inputs)."""
    q, kv_cache, block_tables, context_lens = args
    return q.double(), kv_cache.double(), block_tables, context_lens


BATCHES = [
    pytest.param(MIXED, id="mixed"),
    pytest.param([n for _ in range(6) for n in MIXED][:33], id="batch33"),
    pytest.param([300], id="batch1"),
    pytest.param([17, 17, 17], id="equal-mid-block"),  # no mask: rows past 17 in the last block stay unread
]


@pytest.mark.parametrize("lengths", BATCHES)
def test_mla_decode_cpu(lengths: list[int]) -> None:
    """fp32, mixed contexts over scattered NaN-padded blocks, batch 1 to 33 == the reference (README tolerance
    1e-5; seen about 1e-6)."""
    args = decode_problem(lengths, torch.float32, seed=len(lengths))
    out = run_cpu(args)
    assert_close("mla_decode_cpu_vs_ref", run_ref(args), out, 1e-5)


@pytest.mark.parametrize("lengths", BATCHES)
def test_mla_decode_cpu_bf16(lengths: list[int]) -> None:
    """bf16: scores accumulate in fp32 in the kernel, so the output is closer to the exact (fp64) answer on the same
    inputs than the reference's, which rounds its scores to bf16. Seen here and on the model's shape (scale 192**-0.5,
    batches 1 and 32, contexts 100 and 2,000): cpu vs exact up to 4e-3, the reference vs exact up to 2.2e-2, cpu vs
    the reference up to 2.5e-2."""
    args = decode_problem(lengths, torch.bfloat16, seed=len(lengths) + 100)
    out = run_cpu(args).double()
    exact = run_ref(fp64(args))
    assert_close("mla_decode_cpu_bf16_vs_exact", exact, out, 1e-2)
    assert_close("mla_decode_cpu_bf16_vs_ref", run_ref(args).double(), out, 4e-2)


@pytest.mark.parametrize("rows", [16, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_decode_cpu_pieces(monkeypatch: pytest.MonkeyPatch, rows: int, dtype: torch.dtype) -> None:
    """With a row bound of one or three blocks, every context is walked in pieces (some sequences end exactly on a
    piece boundary and drop out of the later pieces) merged by their logsumexps: the one-call answer, in the
    sequences' own order (bf16: each piece's output is rounded to bf16 before the merge; seen up to 5e-3 vs
    exact)."""
    lengths = [17, 300, 1, 16, 48, 15, 49]
    args = decode_problem(lengths, dtype, seed=rows)
    whole = run_cpu(args)
    monkeypatch.setattr(cpu_decode, "_ROWS_ELEMS", rows * len(lengths) * (RANK + ROPE))
    pieces = run_cpu(args)
    assert_close("mla_decode_cpu_pieces_vs_ref", run_ref(fp64(args)), pieces.double(),
                 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close("mla_decode_cpu_pieces_vs_whole", whole.double(), pieces.double(),
                 1e-5 if dtype == torch.float32 else 1e-2)


def test_mla_decode_cpu_groups_by_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long context does not pad short ones: the 2,000-token sequence is attended alone and the seven 100-token
    ones together (one kernel call each), and the output keeps the batch order."""
    calls: list[tuple[int, int]] = []
    attend = cpu_decode._attend

    def spy(q, kv_cache, block_tables, context_lens, ctx, start, stop, *args):  # type: ignore[no-untyped-def]
        calls.append((q.shape[0], stop - start))
        return attend(q, kv_cache, block_tables, context_lens, ctx, start, stop, *args)

    monkeypatch.setattr(cpu_decode, "_attend", spy)
    lengths = [100, 100, 100, 2000, 100, 100, 100, 100]
    args = decode_problem(lengths, torch.float32, seed=5)
    out = run_cpu(args)
    assert calls == [(1, 2000), (7, 100)]
    assert_close("mla_decode_cpu_groups_vs_ref", run_ref(args), out, 1e-5)


def test_mla_decode_cpu_empty_batch() -> None:
    """No sequences: an empty ``[0, Hm, R]`` output."""
    q, kv_cache, block_tables, context_lens = decode_problem([5], torch.float32, seed=3)
    out = run_cpu((q[:0], kv_cache, block_tables[:0], context_lens[:0]))
    assert out.shape == (0, HEADS, RANK)


def test_mla_decode_dispatch_selects_cpu() -> None:
    """On a CPU, fp32 and bf16 decodes take the cpu backend (and give its output); fp64 stays on the reference."""
    op = dispatch.get("mla_decode")
    for dtype, expected in ((torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float64, dispatch.REF)):
        args = decode_problem([9, 40], dtype, seed=4)
        assert op.select(*args, kv_lora_rank=RANK, scale=SCALE) == expected
    args = decode_problem([9, 40], torch.float32, seed=4)
    assert torch.equal(mla_decode(*args, kv_lora_rank=RANK, scale=SCALE), run_cpu(args))
    args = fp64(args)
    assert torch.equal(mla_decode(*args, kv_lora_rank=RANK, scale=SCALE), run_ref(args))
