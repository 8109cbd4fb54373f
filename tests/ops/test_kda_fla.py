"""fla-core's `chunk_kda` as the `fla` backend of `kda_prefill` (`ops/kda/fla_prefill.py`) against the reference: in
fp32 under the Triton interpreter (marked `interpret`; skipped without triton and fla-core, the kernels extra) and in
bf16 on a GPU (marked `gpu`). Packed varlen batches from gathered non-zero states (an empty sequence among them),
prefix-cache checkpoints anywhere (inside fla's 64-token chunks, at a sequence's end, several per sequence), mild and
K3-steep gates, head sizes that are not powers of two; and a tiny engine end to end on it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.kda import fla_prefill, ref
from tests.ops.test_kda_triton import inputs, rel

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("fla") is None,
                                 reason="needs triton and fla-core (kernels extra)"),
              pytest.mark.usefixtures("default_dispatch")]

# (sequence lengths, their checkpoint positions, heads, K, V)
CASES = [
    ([5, 0, 40, 25], [[2, 5], [], [16, 40], []], 2, 32, 32),
    ([70, 9], [[13, 64, 65], [9]], 2, 48, 40),  # across fla's 64-token chunk; K, V not powers of two
]


def problem(lengths, heads, dk, dv, steep, seed, dtype=torch.float32, device="cpu"):
    q, k, v, g, beta = inputs(sum(lengths), heads, dk, dv, steep, seed, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(2 * len(lengths) + 8, heads, dk, dv, generator=gen) * 0.1).to(device)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (q, k, v, g, beta), pool, cu


@pytest.mark.interpret
@pytest.mark.parametrize(("lengths", "checkpoints", "heads", "dk", "dv", "steep"),
                         [(*CASES[0], False), (*CASES[1], True)], ids=["mild", "k3-steep"])
def test_interpreted_chunk_kda_equals_the_reference(fla_interpreter, lengths, checkpoints, heads, dk, dv, steep):
    """Outputs, final states (written in place into gathered slots) and checkpoint states within 1e-5 of the
    reference; every other slot untouched."""
    (q, k, v, g, beta), pool, cu = problem(lengths, heads, dk, dv, steep, seed=len(lengths) + dk)
    slots = torch.randperm(len(lengths) + 4, generator=torch.Generator().manual_seed(1))[: len(lengths)]
    free = [s for s in range(pool.shape[0]) if s not in slots.tolist()][::-1]
    ckpt_slots = [[free.pop() for _ in c] for c in checkpoints]
    ours, theirs = pool.clone(), pool.clone()
    out = fla_prefill.kda_prefill_fla(q, k, v, g, beta, ours, slots, cu, checkpoints, ckpt_slots)
    want = ref.kda_prefill(q, k, v, g, beta, theirs, slots, cu, checkpoints, ckpt_slots)
    assert out.dtype == torch.float32 and out.shape == want.shape
    assert rel(out, want) <= 1e-5
    written = set(slots.tolist()) | {s for c in ckpt_slots for s in c}
    for s in written:
        assert rel(ours[s], theirs[s]) <= 1e-5, s
    for s in set(range(pool.shape[0])) - written:
        assert torch.equal(ours[s], pool[s]), s


@pytest.mark.interpret
def test_engine_on_interpreted_chunk_kda_equals_the_default_path(fla_interpreter, tiny_dir, monkeypatch):
    """Every KDA prefill of a tiny engine on the interpreted `chunk_kda` (forced), with chunked prefill, a
    prefix-cache checkpoint and a hit on it: the default path's greedy tokens."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.ops import dispatch
    from tests.helpers import prompt_ids

    shared = prompt_ids(600, 20, seed=11)
    prompts = [shared + [5], shared + [9, 3]]  # the second hits the first's checkpoint at 16 tokens
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    path = str(tiny_dir("base"))

    def run() -> list[list[int]]:
        llm = LLM(model=path, max_num_batched_tokens=12)  # prompts in chunks
        return [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], params)]

    want = run()
    monkeypatch.setenv("DELTASERVE_OPS_BACKEND", "kda_prefill=fla")
    dispatch.reset()
    try:
        assert dispatch.log_backends()["kda_prefill"] == ("fla",)
        assert run() == want
    finally:
        monkeypatch.delenv("DELTASERVE_OPS_BACKEND")
        dispatch.reset()


@pytest.mark.gpu
@pytest.mark.parametrize(("lengths", "checkpoints", "heads", "dk", "dv"), CASES)
def test_chunk_kda_on_cuda_bf16(lengths, checkpoints, heads, dk, dv):
    """On a GPU in bf16 (q, k, v; gates, betas and states fp32): chosen by dispatch, within bf16 rounding of the
    reference (outputs 2**-6 relative, states 1e-3)."""
    from deltaserve.ops.kda import kda_prefill

    (q, k, v, g, beta), pool, cu = problem(lengths, heads, dk, dv, True, seed=5, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(len(lengths), device="cuda")
    fresh = iter(range(len(lengths), pool.shape[0]))
    ckpt_slots = [[next(fresh) for _ in c] for c in checkpoints]
    assert fla_prefill.supports(q, k, v, g, beta, pool)
    ours, theirs = pool.clone(), pool.clone()
    out = kda_prefill(q, k, v, g, beta, ours, slots, cu, checkpoints, ckpt_slots)
    want = ref.kda_prefill(q, k, v, g, beta, theirs, slots, cu, checkpoints, ckpt_slots)
    assert rel(out, want) <= 2**-6 and rel(ours, theirs) <= 1e-3
