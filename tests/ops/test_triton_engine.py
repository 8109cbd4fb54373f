"""The Triton kernels inside the engine: a tiny checkpoint end to end on the interpreted kernels (forced: on a CPU the
dispatcher never picks them by itself) gives the default path's greedy tokens, and on an (emulated) CUDA device the
dispatcher picks them for the dtypes they compile for."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (kernels extra)")
KERNELS = "mla_decode=triton,kda_decode=triton"


@pytest.mark.interpret
def test_tiny_engine_on_the_interpreted_kernels_equals_the_default_path(triton_interpreter, tiny_dir, monkeypatch):
    """Every MLA and KDA decode on the kernels, with n-gram speculation, so that verify chunks put several query rows
    of one sequence into an MLA call and scratch slots into KDA calls."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.ops import dispatch
    from tests.helpers import prompt_ids

    repeat = prompt_ids(600, 12, seed=3) * 4  # repetitive: n-gram proposals
    prompts = [repeat, prompt_ids(600, 40, seed=4), prompt_ids(600, 5, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    path = str(tiny_dir("base"))
    want = [o.outputs[0].token_ids for o in LLM(model=path, speculative_config=ngram).generate(prompts, params)]
    monkeypatch.setenv("DELTASERVE_OPS_BACKEND", KERNELS)
    dispatch.reset()
    try:
        llm = LLM(model=path, speculative_config=ngram)
        table = dispatch.log_backends()
        assert table["mla_decode"] == table["kda_decode"] == ("triton",)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        verified = llm.engine.get_stats().spec_num_draft_tokens
    finally:
        monkeypatch.delenv("DELTASERVE_OPS_BACKEND")
        dispatch.reset()
    assert got == want and verified > 0  # proposals verified (a random model rarely accepts them)


SELECT = """
import torch
from deltaserve.ops import dispatch
from deltaserve.ops.kda import kda_decode
from deltaserve.ops.mla import mla_decode
from tests.emulated_cuda import emulated_cuda

picked = []
with emulated_cuda():
    for device, dtype in (("cuda", torch.bfloat16), ("cuda", torch.float32), ("cuda", torch.float64),
                          ("cpu", torch.float32)):
        q = torch.zeros(2, 4, 80, device=device, dtype=dtype)
        cache = torch.zeros(3, 16, 80, device=device, dtype=dtype)
        tables = torch.zeros(2, 1, dtype=torch.long, device=device)
        ctx = torch.ones(2, dtype=torch.long, device=device)
        mla = mla_decode.select(q, cache, tables, ctx, kv_lora_rank=64, scale=0.1)
        pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        pool = torch.zeros(3, 4, 32, 32, device=device, dtype=pool_dtype)
        x = torch.zeros(2, 4, 32, device=device, dtype=dtype)
        beta = torch.zeros(2, 4, device=device, dtype=dtype)
        kda = kda_decode.select(x, x, x, x.float(), beta, pool, slice(0, 2))
        picked.append(f"{mla}/{kda}")
print(" ".join(picked))
"""


def test_dispatch_picks_the_kernels_on_cuda_and_the_cpu_backends_on_a_cpu():
    """With the kernels compiled (no interpreter) on an emulated CUDA device: bf16 and fp32 go to the kernels, fp64
    to the references, CPU tensors to the CPU backends. In a subprocess: the emulator and the interpreter setting are
    process-wide."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DELTASERVE_OPS_BACKEND")}
    res = subprocess.run([sys.executable, "-c", SELECT], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["triton/triton", "triton/triton", "ref/ref", "cpu/cpu"]
