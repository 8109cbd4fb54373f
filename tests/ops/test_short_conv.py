"""Parity and state-pool properties of deltaserve.ops.short_conv (causal depthwise conv, spec §3.1)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import causal_conv1d_fn, causal_conv1d_update

from deltaserve.ops.short_conv import short_conv_decode, short_conv_prefill

CHANNELS, WIDTH, NUM_SLOTS = 13, 4, 9
SENTINEL = 1.0e30


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    """Fail on NaN, shape or dtype mismatch, or a max-abs error above ``rtol * max|ref|``; report both errors."""
    assert not torch.isnan(out).any(), f"{name}: output has NaN"
    assert not torch.isnan(ref).any(), f"{name}: reference has NaN"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    abs_err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    rel_err = abs_err / max(ref.double().abs().max().item() if ref.numel() else 0.0, 1e-30)
    assert rel_err <= rtol, f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} > {rtol:.1e}"


def assert_slots_untouched(pool: torch.Tensor, used: list[int]) -> None:
    """Every slot not in ``used`` still holds the sentinel bit for bit."""
    for slot in range(pool.shape[0]):
        if slot not in used:
            assert torch.equal(pool[slot], torch.full_like(pool[slot], SENTINEL)), f"slot {slot} was modified"


def make_pool(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((NUM_SLOTS, CHANNELS, WIDTH - 1), SENTINEL, dtype=dtype)


def conv_oracle(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers causal_conv1d_fn over ``[window; x]`` (zero left padding); the outputs of the ``x`` rows."""
    stream = torch.cat([window.T.to(x.dtype), x])  # [W-1+L, C]
    out = causal_conv1d_fn(stream.T[None], weight, activation="silu")[0].T  # [W-1+L, C]
    return out[window.shape[1] :]


def random_inputs(g: torch.Generator, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed x [T, C], weight [C, W], initial windows [N, C, W-1]."""
    x = torch.randn(sum(lengths), CHANNELS, generator=g)
    weight = torch.randn(CHANNELS, WIDTH, generator=g) * 0.7
    windows = torch.randn(len(lengths), CHANNELS, WIDTH - 1, generator=g)
    return x, weight, windows


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


LENGTHS = [pytest.param(n, id=f"len{n}") for n in (1, 2, 3, 10)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "rtol"),
    [
        pytest.param(torch.float32, torch.float32, 1e-6, id="fp32"),
        pytest.param(torch.bfloat16, torch.float32, 1e-6, id="x_bf16-w_fp32"),
        pytest.param(torch.bfloat16, torch.bfloat16, 4e-3, id="bf16"),
    ],
)
def test_short_conv_prefill_fresh(length: int, x_dtype: torch.dtype, w_dtype: torch.dtype, rtol: float) -> None:
    """A fresh sequence (zeroed slot) matches transformers causal_conv1d_fn, and the window == last W-1 inputs."""
    g = torch.Generator().manual_seed(length)
    x, weight, _ = random_inputs(g, [length])
    x, weight = x.to(x_dtype), weight.to(w_dtype)
    pool = make_pool(x_dtype)
    pool[4] = 0
    out = short_conv_prefill(x, weight, pool, torch.tensor([4]), cu_of([length]))
    ref = causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T
    assert_close("prefill_fresh", ref, out, rtol)
    expected_window = torch.cat([torch.zeros(WIDTH - 1, CHANNELS, dtype=x_dtype), x])[-(WIDTH - 1) :].T
    assert torch.equal(pool[4], expected_window)
    assert_slots_untouched(pool, used=[4])


@pytest.mark.parametrize("length", LENGTHS)
def test_short_conv_prefill_initial_window(length: int) -> None:
    """Starting from a stored window equals the conv over [window; x]; the new window is its last W-1 entries."""
    g = torch.Generator().manual_seed(10 + length)
    x, weight, windows = random_inputs(g, [length])
    pool = make_pool()
    pool[7] = windows[0]
    out = short_conv_prefill(x, weight, pool, torch.tensor([7]), cu_of([length]))
    assert_close("prefill_window", conv_oracle(windows[0], x, weight), out, 1e-6)
    assert torch.equal(pool[7], torch.cat([windows[0].T, x])[-(WIDTH - 1) :].T)
    assert_slots_untouched(pool, used=[7])


def test_short_conv_prefill_packed_equals_separate() -> None:
    """A packed varlen batch (lengths 1, 2, 3, 10, 0) gives each sequence's output and window as if run alone."""
    lengths, slots = [1, 2, 3, 10, 0], [6, 0, 3, 8, 2]
    g = torch.Generator().manual_seed(20)
    x, weight, windows = random_inputs(g, lengths)
    pool = make_pool()
    pool[slots] = windows
    out = short_conv_prefill(x, weight, pool, torch.tensor(slots), cu_of(lengths), activation="silu")
    cu = cu_of(lengths).tolist()
    for i, slot in enumerate(slots):
        alone = make_pool()
        alone[1] = windows[i]
        ref = short_conv_prefill(x[cu[i] : cu[i + 1]], weight, alone, torch.tensor([1]), cu_of([lengths[i]]))
        # Not bit-exact: PyTorch's vectorised silu and its scalar tail loop may differ in the last bit, and which
        # elements fall in the tail depends on the tensor size (seen: 1.1e-8 relative on an AVX-512 CPU).
        assert_close(f"packed_seq{i}", ref, out[cu[i] : cu[i + 1]], 1e-7)
        assert_close(f"packed_seq{i}", conv_oracle(windows[i], x[cu[i] : cu[i + 1]], weight), ref, 1e-6)
        assert torch.equal(pool[slot], alone[1]), f"window of sequence {i}"
    assert_slots_untouched(pool, used=slots)


@pytest.mark.parametrize("prefix", [pytest.param(n, id=f"prefix{n}") for n in (1, 2, 5)])
def test_short_conv_prefill_then_decode(prefix: int) -> None:
    """Prefill of a prefix then token-by-token decode == one prefill over the whole sequence (outputs and window)."""
    total = 10
    g = torch.Generator().manual_seed(30 + prefix)
    x, weight, windows = random_inputs(g, [total])
    whole_pool, step_pool = make_pool(), make_pool()
    whole_pool[5] = windows[0]
    step_pool[5] = windows[0]
    whole = short_conv_prefill(x, weight, whole_pool, torch.tensor([5]), cu_of([total]))
    parts = [short_conv_prefill(x[:prefix], weight, step_pool, torch.tensor([5]), cu_of([prefix]))]
    for t in range(prefix, total):
        parts.append(short_conv_decode(x[t : t + 1], weight, step_pool, torch.tensor([5])))
    assert_close("prefill_then_decode", whole, torch.cat(parts), 1e-6)
    assert torch.equal(whole_pool, step_pool)
    assert_slots_untouched(step_pool, used=[5])


def test_short_conv_decode_batch_matches_transformers_update() -> None:
    """A batched decode step equals transformers causal_conv1d_update per row, state update included."""
    g = torch.Generator().manual_seed(40)
    slots = [2, 8, 0]
    x, weight, windows = random_inputs(g, [1, 1, 1])
    pool = make_pool()
    pool[slots] = windows
    out = short_conv_decode(x, weight, pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        state = windows[i][None].clone()  # [1, C, W-1]
        ref = causal_conv1d_update(x[i][None, :, None], state, weight, activation="silu")[0, :, 0]
        assert_close(f"decode_row{i}", ref, out[i], 1e-6)
        assert torch.equal(pool[slot], state[0])
    assert_slots_untouched(pool, used=slots)


def test_short_conv_no_activation() -> None:
    """activation=None returns the raw conv; an unknown activation is rejected by name."""
    g = torch.Generator().manual_seed(50)
    x, weight, _ = random_inputs(g, [3])
    pool = torch.zeros(1, CHANNELS, WIDTH - 1)
    out = short_conv_prefill(x, weight, pool, torch.tensor([0]), cu_of([3]), activation=None)
    ref = causal_conv1d_fn(x.T[None], weight, activation=None)[0].T
    assert_close("no_activation", ref, out, 1e-6)
    with pytest.raises(ValueError, match="activation"):
        short_conv_decode(x[:1], weight, pool, torch.tensor([0]), activation="gelu")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float64], ids=["same_dtype", "wider_pool"])
def test_short_conv_decode_slot_range_equals_indices(pool_dtype: torch.dtype) -> None:
    """Consecutive slots given as a slice (no gather/scatter) give bit-identical outputs and windows."""
    g = torch.Generator().manual_seed(41)
    x, weight, windows = random_inputs(g, [1, 1, 1])
    pool = make_pool(pool_dtype)
    pool[4:7] = windows.to(pool_dtype)
    by_index = pool.clone()
    out_index = short_conv_decode(x, weight, by_index, torch.tensor([4, 5, 6]))
    out_slice = short_conv_decode(x, weight, pool, slice(4, 7))
    assert torch.equal(out_index, out_slice) and torch.equal(by_index, pool)
    assert_slots_untouched(pool, used=[4, 5, 6])


@pytest.mark.parametrize("cu_kind", ["host", "tensor"])
def test_short_conv_prefill_checkpoints(cu_kind: str) -> None:
    """The window written at position p of a packed batch, into any slot, equals the window after running the first
    p tokens of that sequence alone (p below W-1 keeps part of the start window); nothing else is touched."""
    lengths, slots = [10, 2, 0, 7], [6, 0, 2, 8]
    positions, ckpt_slots = [[1, 2, 5, 10], [1], [], [7, 3]], [[3, 12, 5, 1], [9], [], [10, 4]]
    g = torch.Generator().manual_seed(60)
    x, weight, windows = random_inputs(g, lengths)
    pool = torch.full((13, CHANNELS, WIDTH - 1), SENTINEL)
    pool[slots] = windows
    cu = cu_of(lengths) if cu_kind == "tensor" else cu_of(lengths).tolist()
    out = short_conv_prefill(x, weight, pool, torch.tensor(slots), cu, checkpoint_positions=positions,
                             checkpoint_slots=ckpt_slots)
    plain = make_pool()
    plain[slots] = windows
    assert torch.equal(out, short_conv_prefill(x, weight, plain, torch.tensor(slots), cu))
    assert torch.equal(pool[slots], plain[slots])
    offsets = cu_of(lengths).tolist()
    for i, (ps, ss) in enumerate(zip(positions, ckpt_slots, strict=True)):
        for p, slot in zip(ps, ss, strict=True):
            alone = make_pool()
            alone[0] = windows[i]
            short_conv_prefill(x[offsets[i] : offsets[i] + p], weight, alone, torch.tensor([0]), cu_of([p]))
            assert torch.equal(pool[slot], alone[0]), f"sequence {i}, position {p}"
    assert_slots_untouched(pool, used=slots + [s for ss in ckpt_slots for s in ss])


def test_short_conv_prefill_checkpoints_validated() -> None:
    """Positions outside 1..len, positions without slots and miscounted slots are refused (ValueError)."""
    g = torch.Generator().manual_seed(61)
    x, weight, _ = random_inputs(g, [4])
    for positions, slots in (([[0]], [[1]]), ([[5]], [[1]]), ([[2]], None), ([[2, 3]], [[1]]), ([], [])):
        with pytest.raises(ValueError, match="checkpoint"):
            short_conv_prefill(x, weight, make_pool(), torch.tensor([0]), [0, 4], checkpoint_positions=positions,
                               checkpoint_slots=slots)
