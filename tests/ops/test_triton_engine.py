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
def run(path: str, prompts: list[list[int]], params, kernels: str | None, monkeypatch, **engine) -> tuple[list, int]:
    """Greedy tokens of `prompts` on a fresh engine (with `kernels` forced), and the proposed tokens it verified."""
    from deltaserve import LLM
    from deltaserve.ops import dispatch

    if kernels:
        monkeypatch.setenv("DELTASERVE_OPS_BACKEND", kernels)
    dispatch.reset()
    try:
        llm = LLM(model=path, **engine)
        if kernels:
            table = dispatch.log_backends()
            assert all(table[op.split("=")[0]] == ("triton",) for op in kernels.split(","))
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return tokens, llm.engine.get_stats().spec_num_draft_tokens
    finally:
        monkeypatch.delenv("DELTASERVE_OPS_BACKEND", raising=False)
        dispatch.reset()


@pytest.mark.interpret
def test_attention_kernels_end_to_end_equal_the_default_path(triton_interpreter, tiny_dir, monkeypatch):
    """Every MLA and KDA decode on the kernels (forced: on a CPU the dispatcher never picks them), with n-gram
    speculation, so that verify chunks put several query rows of one sequence into an MLA call and scratch slots
    into KDA calls: the default path's greedy tokens."""
    from deltaserve import SamplingParams
    from tests.helpers import prompt_ids

    prompts = [prompt_ids(600, 12, seed=3) * 4, prompt_ids(600, 40, seed=4), prompt_ids(600, 5, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)  # the repetitive one: n-gram proposals
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    path = str(tiny_dir("base"))
    want, _ = run(path, prompts, params, None, monkeypatch, speculative_config=ngram)
    got, verified = run(path, prompts, params, "mla_decode=triton,kda_decode=triton", monkeypatch,
                        speculative_config=ngram)
    assert got == want and verified > 0  # proposals verified (a random model rarely accepts them)


@pytest.mark.interpret
def test_moe_kernel_end_to_end_equals_the_default_path(triton_interpreter, tiny_dir, monkeypatch):
    """Every routed-expert call of the K3 tiny checkpoint on the fused kernel (MXFP4 experts decoded in it, SiTU on
    interleaved gate/up rows, fp32 combine): the default path's greedy tokens. Short: the interpreter runs one
    kernel program at a time."""
    from deltaserve import SamplingParams
    from tests.helpers import prompt_ids

    prompts = [prompt_ids(600, 6, seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # a prefill and two decode steps
    path = str(tiny_dir("k3"))
    want, _ = run(path, prompts, params, None, monkeypatch)
    got, _ = run(path, prompts, params, "moe_experts=triton", monkeypatch)
    assert got == want


SELECT = """
import functools
import torch
from deltaserve.ops.activation import situ_and_mul
from deltaserve.ops.moe import moe_experts
from deltaserve.ops.mxfp4 import mxfp4_linear
from deltaserve.ops.mxfp4.ref import MXFP4Tensor
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
        w13 = MXFP4Tensor(torch.zeros(4, 64, 16, dtype=torch.uint8, device=device),
                          torch.zeros(4, 64, 1, dtype=torch.uint8, device=device))
        w2 = MXFP4Tensor(torch.zeros(4, 32, 16, dtype=torch.uint8, device=device),
                         torch.zeros(4, 32, 1, dtype=torch.uint8, device=device))
        tokens = torch.zeros(2, 32, device=device, dtype=dtype)
        moe = moe_experts.select(tokens, w13, w2, beta.float(), torch.zeros(2, 2, dtype=torch.long, device=device),
                                 act=functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0, interleaved=True),
                                 linear=functools.partial(mxfp4_linear, mxfp8_activations=False), fp32_combine=True)
        picked.append(f"{mla}/{kda}/{moe}")
print(" ".join(picked))
"""


def test_dispatch_picks_the_kernels_on_cuda_and_the_cpu_backends_on_a_cpu():
    """With the kernels compiled (no interpreter) on an emulated CUDA device: bf16 and fp32 go to the kernels (MoE:
    K3's MXFP4 experts with SiTU), fp64 to the references, CPU tensors to the CPU backends (KDA decode: the C kernel
    where it builds; MoE: the reference). In a subprocess: the emulator and the interpreter setting are
    process-wide."""
    from deltaserve.ops.kda import native

    cpu_kda = "native" if native.available() else "cpu"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DELTASERVE_OPS_BACKEND")}
    res = subprocess.run([sys.executable, "-c", SELECT], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["triton/triton/triton", "triton/triton/triton", "ref/ref/ref", f"cpu/{cpu_kda}/ref"]
