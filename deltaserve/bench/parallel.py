"""`deltaserve bench parallel`: tensor parallelism against one rank on this machine, and what its collectives cost.

The same decode workload (random prompts, greedy, eos ignored) runs on three engines in alternating rounds: one rank
in a worker process (`mp`, TP=1), and `--tensor-parallel-size` ranks (`mp`, TP=N), plus the in-process worker for
reference. Prints ms per step and the throughput ratio TP=N / TP=1. Then it times the collectives alone: N spawned
gloo ranks all-reduce a decode step's hidden state `[num_prompts, hidden]` fp32 as often as one step does (two per
decoder layer, one for the embedding, one more per K3 LatentMoE layer; the LM head's all-gather timed as well).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelBenchArgs:
    """Workload of the tensor-parallel benchmark."""

    model: str | None = None
    """Checkpoint directory (default: the embedded default model)."""
    tensor_parallel_size: int = 2
    """Ranks of the parallel engine."""
    num_prompts: int = 8
    """Requests decoded together."""
    input_len: int = 32
    """Prompt tokens per request."""
    output_len: int = 64
    """Generated tokens per request (eos ignored)."""
    rounds: int = 3
    """Alternating rounds per engine (the median round is reported)."""
    seed: int = 0
    """Seed of the random prompts."""
    num_threads: int | None = None
    """torch threads of each engine, shared by its ranks (default: one per core)."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        from deltaserve.utils.cli_args import check_at_least_one

        check_at_least_one(self, "tensor_parallel_size", "num_prompts", "input_len", "output_len", "rounds")


def run(args: ParallelBenchArgs) -> dict[str, Any]:
    from deltaserve.bench.executor_overhead import _round
    from deltaserve.bench.offline import random_prompts
    from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from deltaserve.default_model import default_model_dir
    from deltaserve.engine.engine_core import EngineCore

    model = args.model or str(default_model_dir())
    cfg = ModelConfig.from_pretrained(model)
    prompts = random_prompts(cfg.vocab_size, args.num_prompts, args.input_len, args.seed)
    shapes = {"uni TP=1": ParallelConfig(),
              "mp TP=1": ParallelConfig(distributed_executor_backend="mp"),
              f"mp TP={args.tensor_parallel_size}": ParallelConfig(tensor_parallel_size=args.tensor_parallel_size)}
    engines = {name: EngineCore(EngineConfig(model=model, num_threads=args.num_threads, parallel=par,
                                             cache=CacheConfig(enable_prefix_caching=False)))
               for name, par in shapes.items()}
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for name, engine in engines.items():  # warm-up
            _round(engine, [p[::-1] for p in prompts[:2]], _workload(args), f"warm-{name}")
        for r in range(args.rounds):
            for name, engine in engines.items():
                seconds, steps = _round(engine, prompts, _workload(args), f"{name}-{r}")
                per_step[name].append(seconds / steps)
                logger.info("round %d %s: %d steps, %.2f ms/step", r, name, steps, 1e3 * seconds / steps)
    finally:
        for engine in engines.values():
            engine.shutdown()
    med = {name: statistics.median(v) for name, v in per_step.items()}
    tp_name = f"mp TP={args.tensor_parallel_size}"
    n_reduce = 2 * cfg.num_hidden_layers + 1 + (
        sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if cfg.moe.latent_size else 0)
    collectives = time_collectives(args.tensor_parallel_size, (args.num_prompts, cfg.hidden_size),
                                   (args.num_prompts, -(-cfg.vocab_size // args.tensor_parallel_size)))
    per_step_collective = n_reduce * collectives["all_reduce_s"] + collectives["all_gather_s"]
    result = {"args": asdict(args), "ms_per_step": {k: 1e3 * v for k, v in med.items()},
              "rounds_ms_per_step": {k: [1e3 * x for x in v] for k, v in per_step.items()},
              "throughput_ratio_tp_over_tp1": med["mp TP=1"] / med[tp_name],
              "all_reduces_per_step": n_reduce, "all_reduce_ms": 1e3 * collectives["all_reduce_s"],
              "all_gather_ms": 1e3 * collectives["all_gather_s"],
              "collective_ms_per_step": 1e3 * per_step_collective}
    for name, v in med.items():
        print(f"{name:10s} {1e3 * v:8.2f} ms/step  {args.num_prompts / v:8.1f} tok/s")
    print(f"throughput {tp_name} / mp TP=1: x{result['throughput_ratio_tp_over_tp1']:.3f}")
    print(f"collectives per decode step: {n_reduce} all-reduces of [{args.num_prompts}, {cfg.hidden_size}] fp32 "
          f"({1e3 * collectives['all_reduce_s']:.3f} ms each) + the LM head's all-gather "
          f"({1e3 * collectives['all_gather_s']:.3f} ms) = {1e3 * per_step_collective:.2f} ms "
          f"({100 * per_step_collective / med[tp_name]:.0f}% of a TP step)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return result


def _workload(args: ParallelBenchArgs) -> Any:
    """The fields `executor_overhead._round` reads."""
    from deltaserve.bench.executor_overhead import ExecutorBenchArgs

    return ExecutorBenchArgs(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)


REPS = 300
"""Timed calls per collective (the median is reported)."""


def time_collectives(world: int, reduce_shape: tuple[int, int], gather_shape: tuple[int, int]) -> dict[str, float]:
    """Median seconds of one gloo all-reduce of `reduce_shape` and one all-gather of `gather_shape` (fp32) over
    `world` spawned ranks on this machine."""
    import multiprocessing

    from deltaserve.utils.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        procs = [ctx.Process(target=_collective_rank, args=(r, world, port, reduce_shape, gather_shape, str(out)))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a collective benchmark rank failed: exit codes {[p.exitcode for p in procs]}")
        return json.loads(out.read_text())


def _collective_rank(rank: int, world: int, port: int, reduce_shape: tuple[int, int],
                     gather_shape: tuple[int, int], out: str) -> None:
    import torch

    from deltaserve.distributed import init_parallel_group

    torch.set_num_threads(1)
    group = init_parallel_group(rank, world, f"tcp://127.0.0.1:{port}", "cpu")
    x, y = torch.randn(reduce_shape), torch.randn(gather_shape)
    times: dict[str, list[float]] = {"all_reduce_s": [], "all_gather_s": []}
    for _ in range(REPS):
        start = time.perf_counter()
        group.all_reduce(x)
        times["all_reduce_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        group.all_gather(y)
        times["all_gather_s"].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    torch.distributed.barrier()  # no rank leaves while another still talks to it
    torch.distributed.destroy_process_group()


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("parallel", help="tensor parallelism vs one rank, and the per-step collective cost")
    add_dataclass_args(p, ParallelBenchArgs)
    p.set_defaults(func=lambda a: (run(dataclass_from_args(ParallelBenchArgs, a)), 0)[1])
