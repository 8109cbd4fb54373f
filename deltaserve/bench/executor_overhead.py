"""`deltaserve bench executor`: what a worker process costs per step, against the in-process worker.

The same decode workload (random prompts, greedy, eos ignored) runs on an `EngineCore` with the in-process
executor and on one with a worker process (`--distributed-executor-backend mp`), in alternating rounds, so both see
the same machine state. Prints seconds per step of each, their difference and the throughput ratio. As the
difference is within the run-to-run spread on a small CPU, it also times the transport alone: the round trip of an
empty step through the worker process, and pickling the scheduler outputs the workload produced.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltaserve.engine.engine_core import EngineCore
    from deltaserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorBenchArgs:
    """Workload of the executor overhead benchmark."""

    model: str | None = None
    """Checkpoint directory (default: write the default tiny checkpoint to a temporary directory)."""
    num_prompts: int = 8
    """Requests decoded together."""
    input_len: int = 32
    """Prompt tokens per request."""
    output_len: int = 64
    """Generated tokens per request (eos ignored)."""
    rounds: int = 3
    """Alternating rounds per executor (the median round is reported)."""
    seed: int = 0
    """Seed of the random prompts."""
    num_threads: int | None = None
    """torch threads of the worker on both sides (default: torch's choice)."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        from deltaserve.utils.cli_args import check_at_least_one

        check_at_least_one(self, "num_prompts", "input_len", "output_len", "rounds")


def _round(engine: EngineCore, prompts: list[list[int]], args: ExecutorBenchArgs, tag: str) -> tuple[float, int]:
    """Seconds and steps to generate every prompt's tokens."""
    from deltaserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def run(args: ExecutorBenchArgs) -> dict[str, object]:
    from deltaserve.bench.offline import random_prompts
    from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from deltaserve.engine.engine_core import EngineCore

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from deltaserve.models.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny"))
        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
        engines = {
            backend: EngineCore(EngineConfig(
                model=model, num_threads=args.num_threads, cache=CacheConfig(enable_prefix_caching=False),
                parallel=ParallelConfig(distributed_executor_backend=backend)))
            for backend in ("uni", "mp")
        }
        try:
            for backend, engine in engines.items():  # warm-up
                _round(engine, [p[::-1] for p in prompts[:2]], args, f"warm-{backend}")
            per_step: dict[str, list[float]] = {"uni": [], "mp": []}
            scheduled: list[SchedulerOutput] = []
            engines["mp"].step_observer = lambda out, _: scheduled.append(out)
            for r in range(args.rounds):
                for backend, engine in engines.items():
                    seconds, steps = _round(engine, prompts, args, f"{backend}-{r}")
                    per_step[backend].append(seconds / steps)
                    logger.info("round %d %s: %d steps, %.2f ms/step", r, backend, steps, 1e3 * seconds / steps)
            round_trip = _empty_step_round_trip(engines["mp"])
        finally:
            for engine in engines.values():
                engine.shutdown()
    pickle_s, size = _pickling(scheduled)
    uni, mp = statistics.median(per_step["uni"]), statistics.median(per_step["mp"])
    result = {"args": asdict(args), "uni_ms_per_step": 1e3 * uni, "mp_ms_per_step": 1e3 * mp,
              "mp_overhead_ms_per_step": 1e3 * (mp - uni), "throughput_ratio_mp_over_uni": uni / mp,
              "rounds_ms_per_step": {k: [1e3 * v for v in vs] for k, vs in per_step.items()},
              "empty_step_round_trip_ms": 1e3 * round_trip, "scheduler_output_pickle_ms": 1e3 * pickle_s,
              "scheduler_output_bytes": size}
    print(f"in-process worker:  {1e3 * uni:8.3f} ms/step")
    print(f"worker process:     {1e3 * mp:8.3f} ms/step")
    print(f"difference:         {1e3 * (mp - uni):8.3f} ms/step; throughput mp / uni x{uni / mp:.3f}")
    print(f"transport alone:    {1e3 * round_trip:8.3f} ms per empty step round trip (median of {TRIPS}); "
          f"pickling a scheduler output {1e3 * pickle_s:.3f} ms ({size} bytes, mean)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return result


TRIPS = 200
"""Empty steps timed for the transport round trip."""


def _empty_step_round_trip(engine: EngineCore) -> float:
    """Median seconds for the executor to broadcast an empty scheduler output and return the (empty) result."""
    from deltaserve.scheduler.output import SchedulerOutput

    times = []
    for _ in range(TRIPS):
        start = time.perf_counter()
        engine.executor.execute_model(SchedulerOutput(chunks=[]))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pickling(outputs: list[SchedulerOutput]) -> tuple[float, int]:
    """Mean seconds to pickle and unpickle one of `outputs`, and their mean size in bytes."""
    if not outputs:
        return 0.0, 0
    sizes = []
    start = time.perf_counter()
    for out in outputs:
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        sizes.append(len(data))
    return (time.perf_counter() - start) / len(outputs), sum(sizes) // len(sizes)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("executor", help="per-step cost of a worker process vs the in-process worker")
    add_dataclass_args(p, ExecutorBenchArgs)
    p.set_defaults(func=lambda a: (run(dataclass_from_args(ExecutorBenchArgs, a)), 0)[1])
