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


SELECT = """
import logging, sys
import torch
if "hide" in sys.argv:
    sys.modules["fla"] = None
logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
from deltaserve.ops.kda import kda_prefill
from tests.emulated_cuda import emulated_cuda

picked = []
with emulated_cuda():
    for device, dtype in (("cuda", torch.bfloat16), ("cuda", torch.float32), ("cuda", torch.float64),
                          ("cpu", torch.float32)):
        x = torch.zeros(3, 2, 32, device=device, dtype=dtype)
        pool = torch.zeros(2, 2, 32, 32, device=device,
                           dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        beta = torch.zeros(3, 2, device=device, dtype=torch.float32)
        picked.append(kda_prefill.select(x, x, x, x.float(), beta, pool, torch.tensor([0]), [0, 3]))
print("PICKED", " ".join(picked))
"""


@pytest.mark.parametrize("hide", [False, True], ids=["installed", "missing"])
def test_dispatch_picks_chunk_kda_on_cuda_and_falls_back_without_fla(hide):
    """Kernels compiled (no interpreter) on an emulated CUDA device: bf16 and fp32 prefills go to fla's `chunk_kda`,
    fp64 to the reference, CPU tensors to the CPU backend; without fla-core the CUDA prefills take the reference, and
    one log line says so. In a subprocess: the emulator and the interpreter setting are process-wide."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DELTASERVE_OPS_BACKEND")}
    res = subprocess.run([sys.executable, "-c", SELECT, *(["hide"] if hide else [])], capture_output=True, text=True,
                         env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    picked = next(line for line in lines if line.startswith("PICKED")).split()[1:]
    fast = "ref" if hide else "fla"
    assert picked == [fast, fast, "ref", "cpu"]
    assert sum("fla-core is not installed" in line for line in lines) == (1 if hide else 0)


def test_bad_checkpoints_are_the_references_errors() -> None:
    """Checkpoints past a sequence's end, unsorted, or without slots: the reference's ValueError, before any kernel
    runs (so on a CPU without the interpreter too)."""
    (q, k, v, g, beta), pool, cu = problem([5, 4], 2, 32, 32, False, seed=3)
    slots = torch.tensor([0, 1])
    for positions, ckpt_slots in (([[6], []], [[2], []]), ([[3, 2], []], [[2, 3], []]), ([[2], []], None)):
        with pytest.raises(ValueError) as theirs:
            ref.kda_prefill(q, k, v, g, beta, pool.clone(), slots, cu, positions, ckpt_slots)
        with pytest.raises(ValueError) as ours:
            fla_prefill.kda_prefill_fla(q, k, v, g, beta, pool.clone(), slots, cu, positions, ckpt_slots)
        assert str(ours.value) == str(theirs.value)
