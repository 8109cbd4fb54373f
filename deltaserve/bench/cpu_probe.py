"""One CPU benchmark workload in this process, printed as one JSON line: the probe `deltaserve bench cpu` runs once
per measurement, in a fresh process, against the deltaserve tree on PYTHONPATH (the current one or an older commit's
worktree). It uses only the public `LLM` API that every commit since the engine landed has, so it measures any of
them; it is run as a file (`runpy`), never imported from the package under test.

Usage: python cpu_probe.py MODEL DTYPE THREADS WORKLOAD   (WORKLOAD: decode | batch | prefill)
"""

from __future__ import annotations

import json
import sys
import time

import torch

from deltaserve.entrypoints.llm import LLM
from deltaserve.sampling_params import SamplingParams

WORKLOADS = {"decode": (1, 16, 128), "batch": (32, 256, 128), "prefill": (1, 2048, 1)}
"""name -> (prompts, prompt tokens, output tokens): batch-1 decode, 32 x 256 in / 128 out, one 2,048-token prefill."""


def main(model: str, dtype: str, threads: int, workload: str) -> None:
    num, prompt_len, out_len = WORKLOADS[workload]
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, cache_memory="3GiB",
              max_num_batched_tokens=max(2048, prompt_len))
    torch.set_num_threads(threads)  # after the engine: a newer worker sizes its own threads at construction
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def run(n: int, length: int, max_tokens: int) -> float:
        prompts = torch.randint(0, vocab - 64, (n, length), generator=gen).tolist()  # fresh: no prefix hit
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return time.perf_counter() - start

    run(min(num, 2), min(prompt_len, 64), 4)  # warm-up: allocator, first-call work
    if workload == "decode":  # decode steps only: the same request with and without 128 more tokens
        seconds = min(run(1, prompt_len, out_len + 1) - run(1, prompt_len, 1) for _ in range(2))
        value = out_len / seconds
    elif workload == "batch":
        seconds = run(num, prompt_len, out_len)
        value = num * out_len / seconds
    else:
        seconds = min(run(1, prompt_len, 1) for _ in range(2))
        value = prompt_len / seconds
    print(json.dumps({"workload": workload, "tokens_per_s": value, "seconds": seconds,
                      "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
