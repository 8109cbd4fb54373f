"""Parity of the CPU KDA prefill backend (deltaserve.ops.kda.cpu) with the reference, and its dispatch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import dispatch
from deltaserve.ops.kda import cpu, kda_gate, ref
from tests.ops.test_kda import SENTINEL, assert_close, assert_slots_untouched, make_gate

H, K, V = 3, 24, 40
LENS = [1, 15, 16, 17, 100, 0, 300, 33]
SLOTS = [7, 2, 9, 10, 0, 5, 14, 11]
POSITIONS = [[1], [3, 15], [16], [1, 2, 17], [50, 64, 99], [], [1, 128, 255, 300], [32]]
CKPT_SLOTS = [[12], [13, 1], [3], [4, 6, 8], [15, 16, 17], [], [18, 19, 20, 21], [22]]
NUM_SLOTS = 24


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture(params=["default", "one_chunk_groups", "batched_runs", "single_runs", "all_recursive"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend's internal splits forced to their extremes: one chunk per group, every sequence in one batched
    run (padded chunk copies) or each alone, and every (chunk, head) on the reference's recursive scores."""
    if request.param == "one_chunk_groups":
        monkeypatch.setattr(cpu, "_GROUP_ELEMS", 1)
    elif request.param == "batched_runs":
        monkeypatch.setattr(cpu, "_STATE_BYTES", 1 << 40)
        monkeypatch.setattr(cpu, "_ALONE_CHUNKS", 1 << 20)
    elif request.param == "single_runs":
        monkeypatch.setattr(cpu, "_STATE_BYTES", 1)
    elif request.param == "all_recursive":
        monkeypatch.setattr(cpu, "SPAN_LIMIT", -1.0)
    return request.param


def gate(gen: torch.Generator, T: int, kind: str) -> torch.Tensor:
    """Log-decay: "mild" (the test-model initialisation), "k3_bound" (K3's bound, every g near -5: in-chunk spans
    near 80), "steep" (head 0 decays 20x faster: spans past the factorisation limit, the other heads mild),
    "one_deep" (weak decays but a few single g = -95, whose exp(g) is below fp32's normal range, in narrow spans)."""
    if kind == "mild":
        return make_gate(gen, T, H, K, "kimi", torch.float32)
    if kind == "k3_bound":
        f = 8.0 + torch.randn(T, H, K, generator=gen)
        return kda_gate(f, torch.zeros(H), torch.zeros(H * K), lower_bound=-5.0)
    g = make_gate(gen, T, H, K, "kimi", torch.float32)
    if kind == "one_deep":
        g *= 0.05
        g[torch.arange(3, T, 37), 1, 5] = -95.0
    else:
        g[:, 0] = g[:, 0] * 20.0 - 2.0
    return g


def batch(gen: torch.Generator, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Packed q, k, v (in ``dtype``), g, beta for LENS."""
    T = sum(LENS)
    q, k = (torch.randn(T, H, K, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, H, V, generator=gen).to(dtype)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    return q, k, v, gate(gen, T, kind), beta


def cu_of(lens: list[int]) -> list[int]:
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def run(fn, inputs: tuple[torch.Tensor, ...], S0: torch.Tensor, checkpoints: bool) -> tuple[torch.Tensor, ...]:
    """One call of ``fn`` on a sentinel-filled pool holding S0 in SLOTS: output and pool."""
    pool = torch.full((NUM_SLOTS, H, K, V), SENTINEL)
    pool[SLOTS] = S0
    kw = {"checkpoint_positions": POSITIONS, "checkpoint_slots": CKPT_SLOTS} if checkpoints else {}
    out = fn(*inputs, pool, torch.tensor(SLOTS), cu_of(LENS), chunk_size=16, **kw)
    return out, pool


def check_parity(gen: torch.Generator, kind: str, dtype: torch.dtype, out_rtol: float) -> None:
    """Output, final states and checkpoint states of one batch equal the reference's; other slots and the inputs
    are untouched."""
    inputs = batch(gen, kind, dtype)
    before = [x.clone() for x in inputs]
    S0 = torch.randn(len(LENS), H, K, V, generator=gen)
    ref_out, ref_pool = run(ref.kda_prefill, inputs, S0, checkpoints=True)
    out, pool = run(cpu.kda_prefill, inputs, S0, checkpoints=True)
    assert out.dtype == dtype
    assert_close("output", ref_out.float(), out.float(), out_rtol)
    used = SLOTS + [s for ss in CKPT_SLOTS for s in ss]
    for slot in used:
        assert_close(f"state in slot {slot}", ref_pool[slot], pool[slot], 1e-5)
    assert_slots_untouched(pool, used)
    assert torch.equal(pool[SLOTS[LENS.index(0)]], S0[LENS.index(0)]), "an empty sequence changed its state"
    assert all(torch.equal(a, b) for a, b in zip(before, inputs, strict=True)), "an input was written"


DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2**-7, id="bf16")]
"""(activation dtype, output tolerance): bf16 outputs may round the other way, one bf16 step (2**-7 of the largest
output at most)."""


@pytest.mark.parametrize("kind", ["mild", "k3_bound", "steep", "one_deep"])
@pytest.mark.parametrize(("dtype", "out_rtol"), DTYPES)
def test_kda_prefill_cpu_matches_ref(gen: torch.Generator, kind: str, dtype: torch.dtype, out_rtol: float,
                                     variant: str) -> None:
    """A varlen batch from non-zero states, with checkpoints at arbitrary positions, equals the reference (see
    check_parity) under every internal split of the backend."""
    check_parity(gen, kind, dtype, out_rtol)


@pytest.mark.parametrize("kind", ["mild", "k3_bound", "steep", "one_deep"])
@pytest.mark.parametrize(("dtype", "out_rtol"), DTYPES)
def test_kda_prefill_cpu_flushed_subnormals(gen: torch.Generator, kind: str, dtype: torch.dtype,
                                            out_rtol: float) -> None:
    """The same with subnormals flushed to zero, as a CPU worker runs (then a single exp(g) below fp32's normal range
    is 0, and the running decay product must not divide by it)."""
    torch.set_flush_denormal(True)  # conftest restores it after the test
    check_parity(gen, kind, dtype, out_rtol)


def test_kda_prefill_cpu_one_whole_sequence(gen: torch.Generator) -> None:
    """One sequence of whole chunks (chunks are views of the inputs, the output written in place), with q, k, v
    strided views of one projection as the layer passes them: output, final and checkpoint states equal the
    reference's; the inputs are untouched."""
    T = 160
    mixed = torch.randn(T, H * (2 * K + V), generator=gen)
    q, k, v = (m.reshape(T, H, -1) for m in mixed.split([H * K, H * K, H * V], dim=-1))
    inputs = (q, k, v, make_gate(gen, T, H, K, "kimi", torch.float32), torch.sigmoid(torch.randn(T, H, generator=gen)))
    before = [x.clone() for x in inputs]
    S0 = torch.randn(H, K, V, generator=gen)
    outs, pools = [], []
    for fn in (ref.kda_prefill, cpu.kda_prefill):
        pool = torch.full((3, H, K, V), SENTINEL)
        pool[0] = S0
        outs.append(fn(*inputs, pool, torch.tensor([0]), [0, T], [[7, 160]], [[2, 1]], chunk_size=16))
        pools.append(pool)
    assert_close("output", outs[0], outs[1], 1e-5)
    assert_close("states", pools[0], pools[1], 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs, strict=True)), "an input was written"


def test_kda_prefill_cpu_checkpoints_validated(gen: torch.Generator) -> None:
    """Out-of-range or unsorted positions, positions without slots and miscounted slots are refused (ValueError)."""
    inputs = batch(gen, "mild", torch.float32)
    T = sum(LENS)
    bad = [([[0]], [[1]]), ([[T + 1]], [[1]]), ([[5, 3]], [[1, 2]]), ([[5]], None), ([[5, 6]], [[1]]), ([], [])]
    for positions, slots in bad:
        pool = torch.zeros(3, H, K, V)
        with pytest.raises(ValueError, match="checkpoint"):
            cpu.kda_prefill(*inputs, pool, torch.tensor([0]), [0, T], positions, slots)


def test_kda_prefill_dispatch_selects_cpu(gen: torch.Generator) -> None:
    """CPU calls in fp32 and bf16 dispatch to the cpu backend; fp64 calls (and an fp64 pool) to the reference."""
    op = dispatch.get("kda_prefill")
    for dtype, pool_dtype, expected in ((torch.float32, torch.float32, "cpu"), (torch.bfloat16, torch.float32, "cpu"),
                                        (torch.float64, torch.float64, "ref"), (torch.float32, torch.float64, "ref")):
        q, k, v, g, beta = batch(gen, "mild", dtype)
        g = g.to(torch.float64) if dtype == torch.float64 else g
        pool = torch.zeros(NUM_SLOTS, H, K, V, dtype=pool_dtype)
        assert op.select(q, k, v, g, beta, pool, torch.tensor(SLOTS), cu_of(LENS)) == expected, (dtype, pool_dtype)
