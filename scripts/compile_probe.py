"""torch.compile (inductor, CPU) against eager on two decode-step ops at batch 1, one thread: the measurement behind
running the CPU decode eagerly (docs/benchmarks.md, "CPU fast path"); and on the embedded model's block drafter's
whole forward (one block at batch 1), where fusing ~45 small ops pays. Then the drafter's ahead-of-time graphs as the
engine runs them (`DrafterGraphs`, one per batch bucket, compiled or loaded from the compile cache) against eager at
batch 1-16. Prints microseconds per call and compile time.

Usage: python scripts/compile_probe.py
"""

from __future__ import annotations

import time

import torch

from deltaserve.default_model import DSPARK_PATH
from deltaserve.models.dspark import load_drafter
from deltaserve.ops.kda import ref
from deltaserve.ops.norm import ref_rms_norm
from deltaserve.runner.drafter_graphs import DrafterGraphs


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    h, k = 8, 128  # the ~260M benchmark checkpoint's KDA heads
    pool = torch.randn(64, h, k, k) * 0.01
    q, kk, v = (torch.randn(1, h, k) for _ in range(3))
    g, beta, slots = -torch.rand(1, h, k), torch.rand(1, h), slice(3, 4)
    x, w = torch.randn(1, 1024).bfloat16(), torch.randn(1024).bfloat16()
    drafter = load_drafter(DSPARK_PATH)
    cfg = drafter.config
    block = (torch.randn(1, cfg.context_window, cfg.feature_size), torch.ones(1, cfg.context_window, dtype=torch.bool),
             torch.randn(1, cfg.hidden_size))
    for name, fn, args, dynamic in (("kda_decode", ref.kda_decode, (q, kk, v, g, beta, pool, slots), True),
                                    ("rms_norm bf16", ref_rms_norm, (x, w, 1e-5), True),
                                    ("dspark drafter forward", drafter, block, False)):
        eager = per_call_us(lambda fn=fn, args=args: fn(*args))
        start = time.perf_counter()
        compiled = torch.compile(fn, dynamic=dynamic)
        compiled(*args)
        compile_s = time.perf_counter() - start
        fast = per_call_us(lambda compiled=compiled, args=args: compiled(*args))
        print(f"{name}: eager {eager:.1f} us, compiled {fast:.1f} us per call (compile {compile_s:.1f} s)", flush=True)
    graphs = DrafterGraphs(drafter)
    for batch in (1, 2, 4, 8, 16):
        args = (torch.randn(batch, cfg.context_window, cfg.feature_size),
                torch.ones(batch, cfg.context_window, dtype=torch.bool), torch.randn(batch, cfg.hidden_size))
        start = time.perf_counter()
        graphs(*args)
        if (job := graphs.job(batch)) is not None:
            job.result()
        ready_s = time.perf_counter() - start
        assert graphs.ready(batch), "the graph failed (see the log)"
        eager, fast = per_call_us(lambda args=args: drafter(*args)), per_call_us(lambda args=args: graphs(*args))
        print(f"dspark drafter graph, batch {batch}: eager {eager:.1f} us, graph {fast:.1f} us per call "
              f"({eager / fast:.2f}x; ready in {ready_s:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
