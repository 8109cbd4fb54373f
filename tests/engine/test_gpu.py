"""The engine on a CUDA device (skipped without one): same greedy tokens as on the CPU, and `bench offline` runs
there with its roofline share computed against the device's ceilings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltaserve.entrypoints.llm import LLM
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_greedy_equals_cpu(tiny_dir):
    prompts = [[5, 9, 33, 7], list(range(40, 90)), [3] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(model=str(tiny_dir("base"))).generate(prompts, params)]
    gpu = [o.outputs[0].token_ids for o in LLM(model=str(tiny_dir("base")), device="cuda").generate(prompts, params)]
    assert gpu == cpu


def test_cuda_host_tier_rehydration_equals_cpu(tiny_dir):
    """A session evicted from device memory comes back from pinned host memory through the copy stream (layer by
    layer, beside the forward) with the CPU's tokens."""
    from tests.engine.test_host_tier import SMALL, conversation
    from tests.helpers import prompt_ids

    path, first = str(tiny_dir("base")), prompt_ids(600, 96, seed=5)
    cpu = conversation(LLM(model=path, host_cache_memory="16MiB", **SMALL), first)
    llm = LLM(model=path, host_cache_memory="16MiB", device="cuda", **SMALL)
    gpu = conversation(llm, first)
    assert [r.outputs[0].token_ids for r in gpu] == [r.outputs[0].token_ids for r in cpu]
    assert all(r.num_cached_tokens >= 96 for r in gpu[-2:])
    assert llm.engine.executor.worker.runner.host.bytes_in > 0


def test_bench_offline_on_cuda_reports_roofline(tiny_dir, tmp_path):
    result = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", "bench", "offline", "--model",
                          str(tiny_dir("base")), "--device", "cuda", "--num-prompts", "4", "--input-len", "16",
                          "--output-len", "8", "--result-file", str(result)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    ours = json.loads(result.read_text())["deltaserve"]
    roof = ours["roofline"]
    assert roof["decode_steps"] == 7 and 0 < roof["share"] < 1
    graphs = ours["cuda_graphs"]  # fp32: captured unless an op reads the device back (then eager, logged)
    assert not graphs["captured"] or graphs["replays"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graphs_replay_the_eager_tokens(tiny_dir, dtype):
    """Decode steps replayed from CUDA graphs (sizes 1, 2, 4, 8; batches shrinking through them and above the largest)
    give the eager engine's greedy tokens. bf16 must capture (its decode step reads nothing back to the host); fp32
    may fall back to eager steps (torch's fp32 grouped GEMM copies its offsets to the host), with the same tokens."""
    from tests.helpers import prompt_ids

    prompts = [prompt_ids(1024, n, seed=300 + i) for i, n in enumerate((3, 17, 40, 5, 64, 9, 33, 21, 2, 50, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    path = str(tiny_dir("base"))
    eager = LLM(model=path, device="cuda", dtype=dtype, enforce_eager=True)
    assert eager.engine.executor.worker.runner.graphs is None
    graphs = LLM(model=path, device="cuda", dtype=dtype, cuda_graph_sizes=(1, 2, 4, 8))
    runner = graphs.engine.executor.worker.runner
    if dtype == "bfloat16":
        assert runner.graphs is not None and runner.graphs.captured
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    if runner.graphs is not None:
        assert runner.graphs.replays > 0
