"""Prefill and decode step times of the engine on one thread, best of three rounds, for A/B runs of two trees.

Run from outside the repository with the tree to measure first on the path, e.g.
`cd /tmp && PYTHONPATH=/path/to/tree python /path/to/ab_engine_steps.py LABEL CHECKPOINT_DIR`.
"""

from __future__ import annotations

import sys
import time

import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.sampling_params import SamplingParams


def main(label: str, model: str) -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model=model, num_threads=1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 900, (256,), generator=g).tolist() for _ in range(32)]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):
        core.add_request(f"w{i}", p[::-1], warm)
    while core.has_unfinished_requests():
        core.step()
    prefill, decode = [], []
    for rep in range(3):
        params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(f"{rep}-{i}", [(t + rep) % 900 for t in p], params)
        start = time.perf_counter()
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
            core.step()
        prefill.append(time.perf_counter() - start)
        start, steps = time.perf_counter(), 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        decode.append((time.perf_counter() - start) / steps)
    print(f"{label} prefill s (min of 3) {min(prefill):.3f} decode ms/step (min of 3) {1e3 * min(decode):.2f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
