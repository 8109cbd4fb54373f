"""Per-step bookkeeping cost of one long request without a model: `Scheduler.schedule`, `InputBatch.build` and
`Scheduler.update_from_output` (with the `CacheManager`, prefix caching on), averaged over the prefill chunks and over
decode steps, in milliseconds. With work proportional to what a step adds, the decode figures stay flat as the
context grows.

    python scripts/long_context_step_cost.py --lengths 65536,1048576 --chunk 65536
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.config import SchedulerConfig
from deltaserve.request import Request
from deltaserve.runner.input_batch import InputBatch
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import RunnerOutput, SampledToken
from deltaserve.scheduler.scheduler import Scheduler

BLOCK = 16


def measure(length: int, chunk: int, decodes: int = 40) -> tuple[list[float], list[float]]:
    """Mean ms of (schedule, build, update) over the prefill steps, then over `decodes` decode steps."""
    cache = CacheManager(num_blocks=length // BLOCK + 64, num_slots=2, block_size=BLOCK, num_checkpoint_slots=64,
                         enable_prefix_caching=True, checkpoint_interval=512)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=4), cache)
    sched.add_request(Request(request_id="r", prompt_token_ids=[i % 1000 for i in range(length)],
                              params=SamplingParams(max_tokens=decodes + 8), stop_token_ids=frozenset(),
                              arrival_index=0, max_total_tokens=length + decodes + 8))
    batch = InputBatch(block_size=BLOCK, device=torch.device("cpu"), max_num_tokens=chunk)

    def step() -> list[float]:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        batch.build(out.chunks)
        t2 = time.perf_counter()
        sched.update_from_output(out, RunnerOutput(sampled={c.request_id: [SampledToken(5)]
                                                            for c in out.chunks if c.sample}))
        return [t1 - t0, t2 - t1, time.perf_counter() - t2]

    prefill = [step() for _ in range(-(-length // chunk))]
    decode = [step() for _ in range(decodes)][5:]
    return ([1e3 * sum(s[i] for s in prefill) / len(prefill) for i in range(3)],
            [1e3 * sum(s[i] for s in decode) / len(decode) for i in range(3)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536,1048576")
    ap.add_argument("--chunk", type=int, default=65536)
    args = ap.parse_args()
    for length in (int(x) for x in args.lengths.split(",")):
        pre, dec = measure(length, args.chunk)
        print(f"{length:8d} tokens: prefill step (schedule / build / update) {pre[0]:.3f} / {pre[1]:.3f} / "
              f"{pre[2]:.3f} ms; decode step {dec[0]:.3f} / {dec[1]:.3f} / {dec[2]:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
