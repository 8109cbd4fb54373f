"""Parity of the CPU short-conv backend (deltaserve.ops.short_conv.cpu) with the reference, and its dispatch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import dispatch
from deltaserve.ops.short_conv import cpu, native, ref
from tests.ops.test_short_conv import SENTINEL, WIDTH, assert_close, assert_slots_untouched

CHANNELS = 37
LENS = [1, 15, 16, 0, 17, 100, 2, 300]
SLOTS = [6, 0, 3, 8, 2, 11, 13, 1]
POSITIONS = [[1], [2, 15], [16], [], [1, 3, 17], [50], [1, 2], [299, 4, 300]]
CKPT_SLOTS = [[4], [5, 7], [9], [], [10, 12, 14], [15], [16, 17], [18, 19, 20]]
NUM_SLOTS = 22

DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 2**-7, id="x_bf16-w_fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2**-7, id="bf16"),
]
"""(x dtype, weight dtype, output tolerance): the backend fuses each multiply-add (one rounding instead of two), so
fp32 outputs may differ in the last bit and bf16 outputs by one bf16 step (2**-7 of the largest output at most)."""


def inputs(gen: torch.Generator, x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Packed x [T, C], weight [C, W] and a sentinel pool holding random windows in SLOTS."""
    x = torch.randn(sum(LENS), CHANNELS, generator=gen).to(x_dtype)
    weight = (torch.randn(CHANNELS, WIDTH, generator=gen) * 0.7).to(w_dtype)
    pool = torch.full((NUM_SLOTS, CHANNELS, WIDTH - 1), SENTINEL, dtype=x_dtype)
    pool[SLOTS] = torch.randn(len(LENS), CHANNELS, WIDTH - 1, generator=gen).to(x_dtype)
    return x, weight, pool


def cu_of(lens: list[int]) -> list[int]:
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


@pytest.mark.parametrize("cu_kind", ["host", "tensor"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize(("x_dtype", "w_dtype", "rtol"), DTYPES)
def test_short_conv_prefill_cpu_matches_ref(x_dtype: torch.dtype, w_dtype: torch.dtype, rtol: float,
                                            activation: str | None, cu_kind: str) -> None:
    """A varlen batch (lengths below, at and above W-1 and the chunk sizes) from stored windows, with checkpoints at
    any positions: outputs equal the reference's to a rounding; the windows written (final and checkpoints) are
    bit-identical and no other slot is touched."""
    x, weight, pool = inputs(torch.Generator().manual_seed(1), x_dtype, w_dtype)
    cu = cu_of(LENS) if cu_kind == "host" else torch.tensor(cu_of(LENS))
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    kw = {"activation": activation, "checkpoint_positions": POSITIONS, "checkpoint_slots": CKPT_SLOTS}
    expected = ref.short_conv_prefill(x, weight, ref_pool, torch.tensor(SLOTS), cu, **kw)
    out = cpu.short_conv_prefill(x, weight, cpu_pool, torch.tensor(SLOTS), cu, **kw)
    assert_close("prefill", expected, out, rtol)
    assert torch.equal(ref_pool, cpu_pool), "windows differ from the reference's"
    assert_slots_untouched(cpu_pool, used=SLOTS + [s for ss in CKPT_SLOTS for s in ss])


def test_short_conv_prefill_cpu_short_batch() -> None:
    """Only sequences shorter than the window (every row reads its start window) and one empty batch row."""
    lens, slots = [1, 2, 0, 3], [4, 1, 0, 7]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lens), CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    pool = torch.full((NUM_SLOTS, CHANNELS, WIDTH - 1), SENTINEL)
    pool[slots] = torch.randn(len(lens), CHANNELS, WIDTH - 1, generator=gen)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    expected = ref.short_conv_prefill(x, weight, ref_pool, torch.tensor(slots), cu_of(lens))
    assert_close("short", expected, cpu.short_conv_prefill(x, weight, cpu_pool, torch.tensor(slots), cu_of(lens)), 1e-6)
    assert torch.equal(ref_pool, cpu_pool)
    assert_slots_untouched(cpu_pool, used=slots)


@pytest.mark.parametrize("indices", ["tensor", "slice"])
@pytest.mark.parametrize(("x_dtype", "w_dtype", "rtol"), DTYPES)
def test_short_conv_decode_cpu_matches_ref(x_dtype: torch.dtype, w_dtype: torch.dtype, rtol: float,
                                           indices: str) -> None:
    """A batched decode step (slots by index or as a slice) equals the reference's; windows bit-identical."""
    gen = torch.Generator().manual_seed(3)
    x, weight, pool = inputs(gen, x_dtype, w_dtype)
    x = torch.randn(3, CHANNELS, generator=gen).to(x_dtype)
    slots = torch.tensor([11, 12, 13]) if indices == "tensor" else slice(11, 14)
    pool[11:14] = torch.randn(3, CHANNELS, WIDTH - 1, generator=gen).to(x_dtype)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    expected = ref.short_conv_decode(x, weight, ref_pool, slots)
    assert_close("decode", expected, cpu.short_conv_decode(x, weight, cpu_pool, slots), rtol)
    assert torch.equal(ref_pool, cpu_pool)
    assert_slots_untouched(cpu_pool, used=SLOTS + [11, 12, 13])


def test_short_conv_cpu_prefill_then_decode() -> None:
    """With the cpu backend on both sides, a prefix prefill then decode steps equals one prefill over the whole
    sequence (to a rounding: vectorised and scalar loops of the multiply-adds and of silu may differ in the last
    bit), the windows bit for bit."""
    gen = torch.Generator().manual_seed(4)
    total, prefix = 40, 5
    x = torch.randn(total, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    window = torch.randn(CHANNELS, WIDTH - 1, generator=gen)
    whole_pool, step_pool = torch.zeros(2, CHANNELS, WIDTH - 1), torch.zeros(2, CHANNELS, WIDTH - 1)
    whole_pool[1] = step_pool[1] = window
    whole = cpu.short_conv_prefill(x, weight, whole_pool, torch.tensor([1]), [0, total])
    parts = [cpu.short_conv_prefill(x[:prefix], weight, step_pool, torch.tensor([1]), [0, prefix])]
    parts += [cpu.short_conv_decode(x[t : t + 1], weight, step_pool, torch.tensor([1])) for t in range(prefix, total)]
    assert_close("prefill_then_decode", whole, torch.cat(parts), 1e-6)
    assert torch.equal(whole_pool, step_pool)


def test_short_conv_cpu_unknown_activation() -> None:
    """An unknown activation is refused by name, as in the reference."""
    x, weight, pool = inputs(torch.Generator().manual_seed(5), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        cpu.short_conv_prefill(x, weight, pool, torch.tensor(SLOTS), cu_of(LENS), activation="gelu")
    with pytest.raises(ValueError, match="activation"):
        cpu.short_conv_decode(x[:1], weight, pool, torch.tensor([0]), activation="gelu")


def test_short_conv_dispatch_selects_cpu() -> None:
    """CPU fp32 and bf16 calls dispatch to the cpu backend (decodes to the C kernel where it builds), fp64 calls to
    the reference (prefill and decode)."""
    prefill, decode = dispatch.get("short_conv_prefill"), dispatch.get("short_conv_decode")
    fast = "native" if native.available() else "cpu"
    for dtype, expected, expected_decode in ((torch.float32, "cpu", fast), (torch.bfloat16, "cpu", fast),
                                             (torch.float64, "ref", "ref")):
        x, weight, pool = inputs(torch.Generator().manual_seed(6), dtype, dtype)
        assert prefill.select(x, weight, pool, torch.tensor(SLOTS), cu_of(LENS)) == expected, dtype
        assert decode.select(x[:2], weight, pool, torch.tensor([0, 1])) == expected_decode, dtype
