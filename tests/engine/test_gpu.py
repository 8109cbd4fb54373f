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
    roof = json.loads(result.read_text())["deltaserve"]["roofline"]
    assert roof["decode_steps"] == 7 and 0 < roof["share"] < 1
