"""The dense linear at decode row counts: `F.linear` against the native kernel (`ops/linear/native.c`), one weight
copy per call from a pool larger than the caches (so the weights come from memory, as in a model's step).

    python scripts/linear_probe.py --rows 1,2,4,8,16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deltaserve.ops.linear import native


def per_call(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
             pool: list[torch.Tensor], calls: int) -> float:
    """Median seconds of `fn(x, w)` over 5 runs of `calls` calls, cycling through the weights of `pool`."""
    for w in pool[:10]:
        fn(x, w)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            fn(x, pool[i % len(pool)])
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16", help="Comma-separated row counts (at most 16).")
    parser.add_argument("--shape", default="4096,1024", help="Weight shape: out,in.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pool-mib", type=int, default=128, help="Total weight copies (larger than the caches).")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native kernel cannot be built here (no C compiler, or DELTASERVE_NATIVE_KERNELS=0)")
    torch.set_num_threads(args.threads)
    out_f, in_f = (int(v) for v in args.shape.split(","))
    for dtype in (torch.float32, torch.bfloat16):
        size = out_f * in_f * dtype.itemsize
        pool = [torch.randn(out_f, in_f).to(dtype) for _ in range(max(2, args.pool_mib * 2**20 // size))]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f).to(dtype)
            ref = per_call(F.linear, x, pool, args.calls)
            kernel = per_call(native.kernel_linear, x, pool, args.calls)
            print(f"{str(dtype).removeprefix('torch.'):>8} rows {rows:2d}: F.linear {ref * 1e3:6.3f} ms "
                  f"({size / ref / 1e9:5.1f} GB/s), kernel {kernel * 1e3:6.3f} ms ({size / kernel / 1e9:5.1f} GB/s), "
                  f"{ref / kernel:.2f}x", flush=True)


if __name__ == "__main__":
    main()
