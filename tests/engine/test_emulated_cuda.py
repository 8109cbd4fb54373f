"""The engine with ``device="cuda"`` on a CUDA device emulated on the CPU (tests/emulated_cuda.py).

No GPU is lent to CI, so these tests stand in for the placement half of tests/engine/test_gpu.py: every tensor the
engine, the sampler and `bench offline` touch must be on the device a CUDA build demands, and the outputs must be
those of the CPU run (the emulated device computes on the CPU with the reference kernels, so with the CPU run on them
too they are equal bit for bit, sampled rows too).
They also count the device-to-host copies of a decode step, each a stream sync on a real GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from deltaserve.entrypoints.llm import LLM
from deltaserve.sampling_params import SamplingParams, StructuredOutput
from tests.emulated_cuda import CUDA, DeviceMismatchError, EmuTensor, compiler, emulated_cuda

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here: tests/engine/test_gpu.py"),
    pytest.mark.skipif(compiler() is None, reason="the emulated device's guard is built with a C++ compiler"),
]

PROMPTS = [[5, 9, 33, 7], list(range(40, 90)), [3] * 20]

CPU_ONLY_BACKENDS = ("kda_prefill", "kda_decode", "short_conv_prefill", "short_conv_decode", "mla_prefill",
                     "mla_decode", "linear")
"""Ops whose fast backend takes CPU tensors only: the emulated device runs their reference, so the CPU runs it is
compared with must too (the fast CPU kernels round differently; they have parity tests of their own)."""


@pytest.fixture(autouse=True)
def cpu_runs_the_reference_kernels(monkeypatch: pytest.MonkeyPatch):
    from deltaserve.ops import dispatch

    monkeypatch.setenv("DELTASERVE_OPS_BACKEND", ",".join(f"{name}=ref" for name in CPU_ONLY_BACKENDS))
    dispatch.reset()
    yield
    monkeypatch.delenv("DELTASERVE_OPS_BACKEND")
    dispatch.reset()


@contextlib.contextmanager
def moe_reference_on_cpu() -> Iterator[None]:
    """For a CPU run that an emulated-device run is compared with: its MoE on the reference too. The CPU's own MoE
    backend (`cpu_dense`) sums the experts in another order; forcing the reference for the whole test would also take
    the emulated device off its MoE backend (`sorted`), whose host copies `test_step_copies_to_host` counts."""
    from deltaserve.ops import dispatch

    forced = os.environ["DELTASERVE_OPS_BACKEND"]
    os.environ["DELTASERVE_OPS_BACKEND"] = forced + ",moe_experts=ref"
    dispatch.reset()
    try:
        yield
    finally:
        os.environ["DELTASERVE_OPS_BACKEND"] = forced
        dispatch.reset()


def test_emulator_rejects_what_cuda_rejects():
    """The device rule of the emulated CUDA build: mixed devices fail, what CUDA moves by itself passes."""
    with emulated_cuda() as stats:
        a = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
        assert isinstance(a, EmuTensor) and a.device == CUDA and a.is_cuda
        host = torch.ones(3, 4)
        with pytest.raises(DeviceMismatchError, match="cpu"):
            a + host
        with pytest.raises(DeviceMismatchError):
            a @ host.T
        with pytest.raises(DeviceMismatchError):  # a generator must live on the device it draws for
            torch.rand(2, generator=torch.Generator(device="cuda"))
        with pytest.raises(DeviceMismatchError):  # a CPU 0-dim tensor is a scalar only to elementwise ops
            a.index_select(0, torch.tensor(1))
        with pytest.raises(DeviceMismatchError):  # index_put_ with accumulate wants its values on the device
            a.clone().index_put_((torch.tensor([0]),), torch.ones(1, 4), accumulate=True)
        with pytest.raises(DeviceMismatchError, match="cuda:0"):
            torch.zeros(2, device="cuda:1")
        # What CUDA allows: CPU 0-dim scalars in elementwise ops, CPU index tensors, explicit copies, factories
        # with a CPU template.
        b = (a * torch.tensor(2.0))[torch.tensor([0, 2])] + host[:2].to("cuda")
        assert b.device == CUDA and torch.zeros_like(host, device="cuda").device == CUDA
        assert stats.device_to_host == 0
        assert b.tolist() == ((torch.arange(12.0).reshape(3, 4) * 2)[[0, 2]] + 1).tolist()
        assert int(b.sum()) == 96
        assert stats.device_to_host == 2


def test_emulator_counts_syncs_inside_kernels():
    """Kernels that read a result back to the host count as device-to-host copies, like `.item()`."""
    with emulated_cuda(capability=(9, 0)) as stats:
        ids = torch.tensor([3, 1, 3, 0], device="cuda")
        torch.searchsorted(ids.sort().values, torch.arange(4, device="cuda"), right=True)
        assert stats.device_to_host == 0
        torch.bincount(ids)  # reads min and max back
        ids[ids > 1]  # a boolean mask is a nonzero()
        torch.repeat_interleave(ids, ids)  # its output size
        assert stats.device_to_host == 3
        torch.repeat_interleave(ids, ids, output_size=7)
        x, w = torch.ones(4, 8, device="cuda"), torch.ones(2, 8, 8, device="cuda")
        offs = torch.tensor([1, 4], dtype=torch.int32, device="cuda")
        torch.nn.functional.grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)  # sm90 bf16: offsets stay on the GPU
        assert stats.device_to_host == 3
        torch.nn.functional.grouped_mm(x, w, offs=offs)  # fp32: torch's per-group fallback copies the offsets
        assert stats.device_to_host == 4


@pytest.mark.parametrize("variant", ["base", *(pytest.param(v, marks=pytest.mark.slow) for v in ("k3", "odd-sizes"))])
def test_engine_on_emulated_cuda_equals_cpu(tiny_dir, variant):
    """Greedy tokens on the emulated device (chunked prefill) equal the CPU run, for three checkpoint shapes."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with moe_reference_on_cpu():
        cpu = [o.outputs[0].token_ids for o in LLM(model=str(tiny_dir(variant))).generate(PROMPTS, params)]
    with emulated_cuda():
        llm = LLM(model=str(tiny_dir(variant)), device="cuda", max_num_batched_tokens=32)  # chunked prefill
        assert all(p.device == CUDA for p in llm.engine.executor.worker.runner.model.parameters())
        gpu = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert gpu == cpu


def test_sampling_structured_and_prefix_cache_on_emulated_cuda(tiny_dir):
    """Every sampler path (seeded and shared draws, top-k/p, min-p, penalties, min_tokens, logprobs, a grammar
    bitmask, logit_bias, allowed_token_ids, bad words, prompt logprobs) and a prefix-cache hit, on the device, give
    the CPU run's tokens and logprobs."""
    shared = list(range(100, 164))  # four 16-token blocks: the second round hits the cache
    prompts = [shared + [7, 8], shared + [9], [11, 12, 13], [5, 6]]
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.2, max_tokens=8, min_tokens=4, stop_token_ids=(1, 2)),
        SamplingParams(temperature=0.0, max_tokens=6, structured=StructuredOutput(kind="regex", spec="[ab ]+"),
                       logit_bias={97: 5.0}),
        SamplingParams(temperature=0.9, seed=4, max_tokens=6, allowed_token_ids=(3, 50, 97, 400), ignore_eos=True,
                       bad_words_token_ids=((50,), (3, 97)), prompt_logprobs=2),
    ]

    def run(llm: LLM) -> list:
        rounds = [llm.generate(prompts, params) for _ in range(2)]
        assert rounds[1][0].num_cached_tokens >= 48
        return [(c.token_ids, c.logprobs, o.prompt_logprobs) for r in rounds for o in r for c in o.outputs]

    with moe_reference_on_cpu():
        cpu = run(LLM(model=str(tiny_dir("base")), seed=5))
    with emulated_cuda():
        gpu = run(LLM(model=str(tiny_dir("base")), seed=5, device="cuda"))
    assert gpu == cpu


def host_copies_per_step(engine, params: SamplingParams, stats) -> list[int]:
    """`PROMPTS` added to `engine` at once and run to the end: the device-to-host copies of each step."""
    for rid, prompt in enumerate(PROMPTS):
        engine.add_request(str(rid), prompt, params)
    counts: list[int] = []
    while engine.has_unfinished_requests():
        before = stats.device_to_host
        engine.step()
        counts.append(stats.device_to_host - before)
    return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_step_copies_to_host(tiny_dir, dtype):
    """A step in bf16, prefill or decode, copies from the device once: the sampled tokens (the MoE grouped GEMM
    keeps its group offsets on the device, MLA masks its gathered context without nonzero(), KDA plans its chunks
    and checkpoints from host-side offsets). In fp32, torch's grouped GEMM has no CUDA kernel and falls back to a
    per-expert loop that copies the offsets to the host: one more copy per grouped GEMM, two per MoE layer."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    with emulated_cuda(capability=(9, 0)) as stats:
        engine = LLM(model=str(tiny_dir("base")), device="cuda", dtype=dtype).engine
        moe_layers = sum(1 for m in engine.executor.worker.runner.model.modules() if type(m).__name__ == "MoE")
        counts = host_copies_per_step(engine, params, stats)
    # Step 1 prefills all three prompts (saving a prefix-cache checkpoint at token 48 of the second); steps 2-9
    # decode all three.
    assert moe_layers > 0
    expected = 1 if dtype == "bfloat16" else 1 + 2 * moe_layers
    assert counts == [expected] * 9, counts


@pytest.mark.slow  # CI time
def test_bench_offline_on_emulated_h200(tiny_dir):
    """`bench offline --device cuda` end to end, transformers baseline included, with the roofline computed against
    the H200 figures (the timings are the CPU's, so the share itself means nothing here)."""
    from deltaserve.bench.offline import OfflineBenchArgs, run

    args = OfflineBenchArgs(model=str(tiny_dir("base")), device="cuda", num_prompts=4, input_len=16, output_len=8)
    with emulated_cuda(name="NVIDIA H200"):
        result = run(args)
    roof = result["deltaserve"]["roofline"]
    assert roof["decode_steps"] == 7 and roof["mean_batch"] == 4.0
    assert roof["ceilings_source"].startswith("H200") and 0 < roof["share"] < 1
    assert result["transformers"]["output_tokens"] == 4 * 8 and result["speedup"] > 0


def test_expanded_sdpa_prefill_on_emulated_cuda(tiny_dir, monkeypatch: pytest.MonkeyPatch):
    """The CUDA prefill backend (`mla_prefill` -> `expanded_sdpa`, forced as a GPU would choose it) over whole
    prompts: the CPU run's greedy tokens, and in bf16 still one device-to-host copy per step (it reads the lengths
    from the host). Chunks after cached positions take `causal_lower_right`, a tensor subclass the emulator cannot
    wrap: tests/ops/test_mla_expanded_sdpa.py checks that path against the reference on real CPU tensors."""
    from deltaserve.ops import dispatch

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    path = str(tiny_dir("base"))
    with moe_reference_on_cpu():
        cpu = [o.outputs[0].token_ids for o in LLM(model=path).generate(PROMPTS, params)]
    forced = os.environ["DELTASERVE_OPS_BACKEND"].replace("mla_prefill=ref", "mla_prefill=expanded_sdpa")
    monkeypatch.setenv("DELTASERVE_OPS_BACKEND", forced)
    dispatch.reset()
    with emulated_cuda(capability=(9, 0)) as stats:
        gpu = LLM(model=path, device="cuda", enforce_eager=True).generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in gpu] == cpu
        counts = host_copies_per_step(LLM(model=path, device="cuda", dtype="bfloat16", enforce_eager=True).engine,
                                      params, stats)
    assert counts == [1] * 5, counts


def test_a_decode_step_that_cannot_be_captured_leaves_the_engine_eager(tiny_dir, caplog):
    """On a CUDA device the worker warms the decode graphs up before capturing them; where that fails (here: the
    emulated device has no CUDA runtime for the sync check) one line says so and every step runs eagerly, with the CPU
    run's tokens."""
    import logging

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with moe_reference_on_cpu():
        cpu = [o.outputs[0].token_ids for o in LLM(model=str(tiny_dir("base"))).generate(PROMPTS, params)]
    with caplog.at_level(logging.INFO, logger="deltaserve"), emulated_cuda():
        llm = LLM(model=str(tiny_dir("base")), device="cuda", cuda_graph_sizes=(1, 2, 4))
        assert llm.engine.executor.worker.runner.graphs is None
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == cpu
    assert sum("CUDA graphs off" in r.getMessage() for r in caplog.records) == 1
