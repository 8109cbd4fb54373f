"""Parity of deltaserve.ops.kda (reference KDA) with transformers' Kimi Linear kernels and with its own recurrence."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from deltaserve.ops.kda import kda_decode, kda_gate, kda_prefill, ref

SENTINEL = 1e30


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    """Fail on NaN/inf, shape mismatch, or a max-abs error above ``rtol * max|ref|``; report both errors."""
    assert torch.isfinite(out).all(), f"{name}: output has NaN/inf"
    assert torch.isfinite(ref).all(), f"{name}: reference has NaN/inf"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    abs_err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    rel_err = abs_err / max(ref.double().abs().max().item() if ref.numel() else 0.0, 1e-30)
    assert rel_err <= rtol, f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} > {rtol:.1e}"


def assert_slots_untouched(pool: torch.Tensor, used: list[int]) -> None:
    """Every slot not in ``used`` still holds the sentinel, bit for bit."""
    free = [s for s in range(pool.shape[0]) if s not in used]
    assert torch.equal(pool[free], torch.full_like(pool[free], SENTINEL)), "an unreferenced pool slot was written"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture(params=["default_groups", "one_chunk_groups"])
def groups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the default intra-chunk grouping and with one chunk per group (steps split across groups)."""
    if request.param == "one_chunk_groups":
        monkeypatch.setattr(ref, "_GROUP_ELEMS", 1)
    return request.param


def make_gate(gen: torch.Generator, T: int, H: int, K: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Log-decay from kda_gate with the test-model initialisation of spec §3.3 (kind "kimi") or the K3 bound."""
    f = torch.randn(T, H, K, generator=gen, dtype=dtype)
    A_log = torch.log(torch.empty(H, dtype=dtype).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(H * K, dtype=dtype).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return kda_gate(f, A_log, dt_bias, lower_bound=-5.0 if kind == "k3" else None)


def make_inputs(
    gen: torch.Generator, T: int, H: int, K: int, V: int, kind: str = "kimi", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Random raw q, k, v, log-decay g and sigmoid-ed beta for T tokens."""
    q = torch.randn(T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(T, H, V, generator=gen, dtype=dtype)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=dtype))
    return q, k, v, make_gate(gen, T, H, K, kind, dtype), beta


def decode_all(inputs: tuple[torch.Tensor, ...], S0: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token-by-token kda_decode from S0: outputs [T, H, V] and the state after each token."""
    pool = S0.unsqueeze(0).clone()
    outs, states = [], []
    for t in range(inputs[0].shape[0]):
        outs.append(kda_decode(*(x[t : t + 1] for x in inputs), pool, torch.tensor([0])))
        states.append(pool[0].clone())
    return torch.cat(outs), states


def prefill_one(
    inputs: tuple[torch.Tensor, ...], S0: torch.Tensor, positions: tuple[int, ...] = (), **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kda_prefill of one sequence from S0 in slot 0, writing its checkpoints at `positions` to slots 1, 2, ...:
    output, final state, checkpoint states."""
    pool = torch.full((1 + len(positions), *S0.shape), SENTINEL, dtype=S0.dtype)
    pool[0] = S0
    ckpt = {"checkpoint_positions": [list(positions)], "checkpoint_slots": [list(range(1, 1 + len(positions)))]}
    o = kda_prefill(*inputs, pool, torch.tensor([0]), torch.tensor([0, inputs[0].shape[0]]),
                    **(ckpt if positions else {}), **kw)
    return o, pool[0], pool[1:]


@pytest.mark.parametrize("init", ["zero_state", "random_state"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200], ids=lambda t: f"T{t}")
def test_kda_prefill_matches_transformers(gen: torch.Generator, T: int, init: str) -> None:
    """One-sequence prefill equals transformers' chunked and recurrent KDA (output and final state)."""
    H, K, V = 3, 24, 40
    inputs = make_inputs(gen, T, H, K, V)
    S0 = torch.randn(H, K, V, generator=gen) if init == "random_state" else torch.zeros(H, K, V)
    o, S, _ = prefill_one(inputs, S0)
    batched = [x.unsqueeze(0) for x in inputs]
    for name, fn in (("chunk", chunk_kimi_delta_attention), ("recurrent", recurrent_kimi_delta_attention)):
        ref_o, ref_S = fn(
            *batched, initial_state=S0.unsqueeze(0).clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert_close(f"{name} output", ref_o[0], o, rtol=1e-5)
        assert_close(f"{name} state", ref_S[0], S, rtol=1e-5)


DTYPE_TOL = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float64, 1e-12, id="fp64")]


@pytest.mark.parametrize(("dtype", "rtol"), DTYPE_TOL)
@pytest.mark.parametrize("kind", ["kimi", "k3"])
@pytest.mark.parametrize("T", [1, 5, 64, 130], ids=lambda t: f"T{t}")
def test_kda_prefill_matches_decode(gen: torch.Generator, T: int, kind: str, dtype: torch.dtype, rtol: float) -> None:
    """The chunked form equals the token recurrence of kda_decode (output and state), both gate variants."""
    H, K, V = 3, 24, 40
    inputs = make_inputs(gen, T, H, K, V, kind, dtype)
    S0 = torch.randn(H, K, V, generator=gen, dtype=dtype)
    o, S, _ = prefill_one(inputs, S0)
    ref_o, ref_states = decode_all(inputs, S0)
    assert o.dtype == dtype and S.dtype == dtype
    assert_close("output", ref_o, o, rtol)
    assert_close("state", ref_states[-1], S, rtol)


@pytest.mark.parametrize("chunk_size", [64, 16, 48], ids=lambda c: f"C{c}")
def test_kda_prefill_varlen_state_pool(gen: torch.Generator, chunk_size: int, groups: str) -> None:
    """A packed batch equals each sequence alone; states go to their scattered slots and other slots are untouched."""
    H, K, V = 3, 24, 40
    lens, slots = [1, 63, 0, 64, 65, 130], [7, 2, 9, 10, 0, 5]
    seqs = [make_inputs(gen, n, H, K, V, kind) for n, kind in zip(lens, ["kimi", "k3"] * 3, strict=True)]
    pool = torch.full((12, H, K, V), SENTINEL)
    S0 = torch.randn(len(lens), H, K, V, generator=gen)
    pool[slots] = S0
    packed = [torch.cat(parts) for parts in zip(*seqs, strict=True)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o = kda_prefill(*packed, pool, torch.tensor(slots), cu, chunk_size=chunk_size)
    assert_slots_untouched(pool, slots)
    for i, inputs in enumerate(seqs):
        ref_o, ref_S, _ = prefill_one(inputs, S0[i], chunk_size=chunk_size)
        assert_close(f"seq {i} output", ref_o, o[cu[i] : cu[i + 1]], rtol=1e-6)
        assert_close(f"seq {i} state", ref_S, pool[slots[i]], rtol=1e-6)
    assert torch.equal(pool[slots[2]], S0[2]), "an empty sequence changed its state"


@pytest.mark.parametrize("chunk_size", [64, 16], ids=lambda c: f"C{c}")
def test_kda_prefill_checkpoints(gen: torch.Generator, chunk_size: int, groups: str) -> None:
    """The state written at position p of a packed varlen batch, into any slot, equals the recurrent state after the
    first p tokens of that sequence alone; the final states are unchanged and no other slot is touched."""
    H, K, V = 3, 24, 40
    lens, slots = [130, 70], [3, 1]
    positions = [[1, 16, 17, 64, 65, 100, 130], [3, 64, 70]]
    ckpt_slots = [[13, 0, 5, 8, 2, 11, 6], [9, 4, 12]]
    seqs = [make_inputs(gen, n, H, K, V, kind) for n, kind in zip(lens, ["kimi", "k3"], strict=True)]
    S0 = torch.randn(len(lens), H, K, V, generator=gen)
    pool = torch.full((15, H, K, V), SENTINEL)
    pool[slots] = S0
    packed = [torch.cat(parts) for parts in zip(*seqs, strict=True)]
    kda_prefill(*packed, pool, torch.tensor(slots), [0, 130, 200], positions, ckpt_slots, chunk_size)
    assert_slots_untouched(pool, slots + [s for ss in ckpt_slots for s in ss])
    for i, inputs in enumerate(seqs):
        _, states = decode_all(inputs, S0[i])
        for p, slot in zip(positions[i], ckpt_slots[i], strict=True):
            assert_close(f"seq {i} checkpoint at {p}", states[p - 1], pool[slot], rtol=1e-5)
        assert_close(f"seq {i} final state", states[-1], pool[slots[i]], rtol=1e-5)


def test_kda_prefill_checkpoints_validated(gen: torch.Generator) -> None:
    """Out-of-range or unsorted positions, positions without slots and miscounted slots are refused (ValueError)."""
    inputs = make_inputs(gen, 10, 2, 8, 8)
    bad = [([[0]], [[1]]), ([[11]], [[1]]), ([[5, 3]], [[1, 2]]), ([[5]], None), ([[5, 6]], [[1]]), ([], [])]
    for positions, slots in bad:
        pool = torch.zeros(3, 2, 8, 8)
        with pytest.raises(ValueError, match="checkpoint"):
            kda_prefill(*inputs, pool, torch.tensor([0]), [0, 10], positions, slots)


def test_kda_gate_kimi_matches_transformers(gen: torch.Generator) -> None:
    """The Kimi Linear gate equals KimiLinearForgetGate's math (softplus(z) = z above 20), and g <= 0."""
    T, H, K = 9, 3, 24
    f = torch.randn(T, H, K, generator=gen) * 10.0
    f[:, 0, :4] = 30.0  # above the linear threshold
    A_log = torch.log(torch.empty(1, 1, H, 1).uniform_(1.0, 16.0, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen)
    z = f + dt_bias.view(1, H, K)  # transformers' forward, on [B=1, T, H, K] after the projections
    ref = -torch.exp(A_log) * torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))
    g = kda_gate(f, A_log, dt_bias)
    assert g.dtype == torch.float32 and (g <= 0).all()
    assert_close("kimi gate", ref.view(T, H, K), g, rtol=1e-6)
    assert_close("linear branch", -torch.exp(A_log[0, 0, 0]) * z[:, 0, :4], g[:, 0, :4], rtol=0.0)


def test_kda_gate_k3_lower_bound(gen: torch.Generator) -> None:
    """The K3 gate is lb * sigmoid(exp(A_log[:H]) * (f + dt_bias)) with A_log zero-padded to 128; -5 < g <= 0."""
    T, H, K = 9, 3, 24
    f = torch.randn(T, H, K, generator=gen, dtype=torch.bfloat16) * 4.0
    A_log = torch.zeros(128)
    A_log[:H] = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    ref = -5.0 * torch.sigmoid(torch.exp(A_log[:H]).view(1, H, 1) * (f.float() + dt_bias.view(1, H, K)))
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32 and (g <= 0).all() and (g >= -5.0).all()
    assert_close("k3 gate", ref, g, rtol=1e-6)


@pytest.mark.parametrize("split", [1, 63, 64, 100], ids=lambda s: f"prefill{s}")
def test_kda_prefill_then_decode(gen: torch.Generator, split: int) -> None:
    """Prefill of a prefix followed by kda_decode steps equals one prefill over the whole sequence."""
    H, K, V, T = 3, 24, 40, 110
    inputs = make_inputs(gen, T, H, K, V, "k3")
    S0 = torch.randn(H, K, V, generator=gen)
    ref_o, ref_S, _ = prefill_one(inputs, S0)
    pool = torch.full((3, H, K, V), SENTINEL)
    pool[2] = S0
    slot = torch.tensor([2])
    outs = [kda_prefill(*(x[:split] for x in inputs), pool, slot, torch.tensor([0, split]))]
    outs += [kda_decode(*(x[t : t + 1] for x in inputs), pool, slot) for t in range(split, T)]
    assert_slots_untouched(pool, [2])
    assert_close("output", ref_o, torch.cat(outs), rtol=1e-5)
    assert_close("state", ref_S, pool[2], rtol=1e-5)


def test_kda_decode_state_pool(gen: torch.Generator) -> None:
    """A decode batch updates each row's own scattered slot (spec §3.5 formulas) and leaves the others untouched."""
    N, H, K, V = 4, 3, 24, 40
    q, k, v, g, beta = make_inputs(gen, N, H, K, V)
    slots = [5, 0, 3, 6]
    pool = torch.full((8, H, K, V), SENTINEL)
    S0 = torch.randn(N, H, K, V, generator=gen)
    pool[slots] = S0
    o = kda_decode(q, k, v, g, beta, pool, torch.tensor(slots))
    assert_slots_untouched(pool, slots)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = S0 * g.exp().unsqueeze(-1)
    S = S + kn.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - torch.einsum("nhkv,nhk->nhv", S, kn))).unsqueeze(-2)
    assert_close("state", S, pool[slots], rtol=1e-6)
    assert_close("output", torch.einsum("nhkv,nhk->nhv", S, qn), o, rtol=1e-6)


@pytest.mark.parametrize("g_step", [-5.0, -60.0], ids=["k3_bound", "steep"])
def test_kda_prefill_large_negative_gate(gen: torch.Generator, g_step: float) -> None:
    """Decay at the K3 bound (-5 per step, -320 per chunk) or steeper stays finite and equals the recurrence."""
    H, K, V, T = 3, 24, 40, 200
    q, k, v, _, beta = make_inputs(gen, T, H, K, V)
    g = torch.full((T, H, K), g_step)
    g[::7, :, :5] = -1e-3  # some slow channels keep a long memory next to the fast ones
    S0 = torch.randn(H, K, V, generator=gen)
    o, S, ck = prefill_one((q, k, v, g, beta), S0, positions=(1, 37, 64, 150))
    ref_o, states = decode_all((q, k, v, g, beta), S0)
    assert_close("output", ref_o, o, rtol=1e-5)
    assert_close("state", states[-1], S, rtol=1e-5)
    assert_close("checkpoints", torch.stack([states[p - 1] for p in (1, 37, 64, 150)]), ck, rtol=1e-5)


def test_kda_prefill_bf16_io(gen: torch.Generator) -> None:
    """bf16 inputs give a bf16 output computed in fp32 (equal to the fp32 run on the same rounded inputs)."""
    inputs = make_inputs(gen, 70, 2, 16, 16)
    half = tuple(x.to(torch.bfloat16) if i in (0, 1, 2) else x for i, x in enumerate(inputs))
    o, S, _ = prefill_one(half, torch.zeros(2, 16, 16))
    ref_o, ref_S, _ = prefill_one(tuple(x.float() for x in half), torch.zeros(2, 16, 16))
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_close("output", ref_o.to(torch.bfloat16).float(), o.float(), rtol=0.0)
    assert_close("state", ref_S, S, rtol=0.0)


@pytest.mark.parametrize(("dtype", "pool_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.float64),
                                                   (torch.float64, torch.float32)], ids=["fp32", "fp64_pool", "fp64_q"])
def test_kda_decode_slot_range_equals_indices(gen: torch.Generator, dtype: torch.dtype, pool_dtype: torch.dtype):
    """Consecutive slots given as a slice (updated in place, no gather) give bit-identical outputs and states."""
    N, H, K, V = 4, 3, 24, 40
    q, k, v, g, beta = make_inputs(gen, N, H, K, V, dtype=dtype)
    pool = torch.full((9, H, K, V), SENTINEL, dtype=pool_dtype)
    pool[3:7] = torch.randn(N, H, K, V, generator=gen, dtype=pool_dtype)
    by_index = pool.clone()
    o_index = kda_decode(q, k, v, g, beta, by_index, torch.arange(3, 7))
    o_slice = kda_decode(q, k, v, g, beta, pool, slice(3, 7))
    assert torch.equal(o_index, o_slice)
    assert torch.equal(by_index, pool)  # updated slots identical, the others still the sentinel
    assert_slots_untouched(pool, [3, 4, 5, 6])
