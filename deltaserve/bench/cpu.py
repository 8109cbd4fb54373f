"""`deltaserve bench cpu`: the CPU fast path's three figures against another commit, alternating in one run.

For every thread count and dtype, each workload of `cpu_probe.py` (batch-1 decode tokens/s, 32 x 256 in / 128 out
output tokens/s, one 2,048-token prefill's tokens/s) runs in a fresh process, alternately from this tree and from a
worktree of `--baseline-rev` (the order flipped every round, so that a drift of the machine hits both alike); each
side's median over `--rounds` and the ratio are printed. The decode bandwidth share is the batch-1 step's active
weight and cache bytes (`bench/roofline.py`, counted on this tree's model) over its measured step time, against this
machine's read bandwidth at that thread count (a sum over 1 GiB, best of 5).

Without `--model` the benchmark checkpoint of the CPU fast-path issue is written to a temporary directory (about
260M parameters, 1 GB in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_SPEC: dict[str, Any] = dict(
    hidden=1024, layers=8, vocab=16384, intermediate=2816, moe_intermediate=512, experts=16, top_k=2, shared_experts=1,
    num_expert_group=1, topk_group=1, kda_heads=8, kda_head_dim=128, mla_heads=8, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense=1,
)
"""The ~260M checkpoint of the issue (`deltaserve make-tiny` with these sizes)."""

PROBE = Path(__file__).with_name("cpu_probe.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuBenchArgs:
    """What `deltaserve bench cpu` measures."""

    model: str | None = None
    """Checkpoint directory (default: write the issue's ~260M benchmark checkpoint to a temporary directory)."""
    baseline_rev: str | None = None
    """Git revision of this repository to compare against (checked out in a temporary worktree); none: this tree
    alone."""
    threads: str = "1,2"
    """Comma-separated torch thread counts."""
    dtypes: str = "float32,bfloat16"
    """Comma-separated dtypes."""
    workloads: str = "decode,batch,prefill"
    """Comma-separated workloads of cpu_probe.py: decode (batch 1, 16 in / 128 out), batch (32 x 256 in / 128 out),
    prefill (one 2,048-token prompt)."""
    rounds: int = 2
    """Runs of each side per figure (alternating)."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        from deltaserve.bench.cpu_probe import WORKLOADS

        unknown = set(self.workloads.split(",")) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"workloads: unknown {sorted(unknown)} (known: {sorted(WORKLOADS)})")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


def probe(tree: Path, model: str, dtype: str, threads: int, workload: str) -> float:
    """Tokens/s of one workload, measured in a fresh process importing deltaserve from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    code = f"import runpy, sys; sys.argv = [''] + sys.argv[1:]; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code, model, dtype, str(threads), workload], env=env,
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"probe {workload} {dtype} x{threads} in {tree} failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def decode_bytes(model: str, dtype: str, context: int) -> float:
    """Bytes one batch-1 decode step reads at this context length (weights touched, state, KV), counted on a model
    built on the meta device (no weights read)."""
    import torch

    from deltaserve.bench.roofline import model_bytes
    from deltaserve.config import ModelConfig
    from deltaserve.models.registry import model_class

    config = ModelConfig.from_pretrained(model)
    with torch.device("meta"):
        net = model_class(config)(config, dtype=getattr(torch, dtype))
    return model_bytes(net).step_bytes([context])


def read_bandwidth(threads: int) -> float:
    """This machine's read bandwidth in bytes/s with `threads` torch threads."""
    import torch

    from deltaserve.bench.roofline import measure_ceilings

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_ceilings(torch.device("cpu"), torch.float32).bandwidth
    finally:
        torch.set_num_threads(before)


def run(args: CpuBenchArgs) -> dict[str, Any]:
    """Measure, print and return {"rows": [...]} (one row per thread count, dtype and workload)."""
    tmp = tempfile.TemporaryDirectory(prefix="deltaserve-bench-cpu-")
    model = args.model
    if model is None:
        from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint

        print("writing the ~260M benchmark checkpoint...", flush=True)
        model = str(write_tiny_checkpoint(Path(tmp.name) / "model", TinySpec(**BENCH_SPEC)))
    sides: dict[str, Path] = {"this tree": REPO}
    if args.baseline_rev:
        worktree = Path(tmp.name) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.baseline_rev],
                       check=True, capture_output=True)
        sides = {args.baseline_rev: worktree, "this tree": REPO}
    rows = []
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            bandwidth = read_bandwidth(threads)
            print(f"{threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
            for dtype in args.dtypes.split(","):
                for workload in args.workloads.split(","):
                    runs: dict[str, list[float]] = {name: [] for name in sides}
                    for r in range(args.rounds):
                        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                            runs[name].append(probe(sides[name], model, dtype, threads, workload))
                            print(f"  {dtype} x{threads} {workload} round {r + 1} {name}: "
                                  f"{runs[name][-1]:.1f} tok/s", flush=True)
                    row: dict[str, Any] = {"threads": threads, "dtype": dtype, "workload": workload,
                                           **{name: statistics.median(v) for name, v in runs.items()}}
                    if args.baseline_rev:
                        row["ratio"] = row["this tree"] / row[args.baseline_rev]
                    if workload == "decode":  # mean context of the timed steps: 16 prompt + 64 generated
                        step_bytes = decode_bytes(model, dtype, 16 + 64)
                        row["decode_gbs"] = step_bytes * row["this tree"] / 1e9
                        row["bandwidth_share"] = row["decode_gbs"] * 1e9 / bandwidth
                    rows.append(row)
                    print(_line(row, args.baseline_rev), flush=True)
    finally:
        if args.baseline_rev:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(sides[args.baseline_rev])],
                           check=False, capture_output=True)
        tmp.cleanup()
    result = {"model": args.model or "bench checkpoint (BENCH_SPEC)", "baseline_rev": args.baseline_rev, "rows": rows}
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _line(row: dict[str, Any], baseline: str | None) -> str:
    text = f"{row['dtype']:>8} x{row['threads']} {row['workload']:<7} this tree {row['this tree']:8.1f} tok/s"
    if baseline:
        text += f" | {baseline} {row[baseline]:8.1f} tok/s | ratio {row['ratio']:.2f}x"
    if "bandwidth_share" in row:
        text += f" | decode reads {row['decode_gbs']:.1f} GB/s = {100 * row['bandwidth_share']:.0f}% of bandwidth"
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `cpu` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args

    p = sub.add_parser("cpu", help="CPU decode, batch and prefill figures against another commit, alternating",
                       description=__doc__.splitlines()[0])
    add_dataclass_args(p, CpuBenchArgs)
    p.set_defaults(func=lambda a: (run(_args(a)), 0)[1])


def _args(ns: argparse.Namespace) -> CpuBenchArgs:
    from deltaserve.utils.cli_args import dataclass_from_args

    return dataclass_from_args(CpuBenchArgs, ns)
