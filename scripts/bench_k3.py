"""Kimi K3 costs on CPU: the MXFP4 routed-expert path against the same experts in bf16, and Block AttnRes on a forward.

1. Experts: one LatentMoE expert step (`ops.moe.moe_experts`, SiTU, late fp32 combine) with the same random experts
   as MXFP4 (dequantised on the fly by the reference kernel; optionally MXFP8 activations) and decoded to dense bf16
   and fp32. Times are interleaved in this process; memory (RSS) is measured per variant in a fresh subprocess that
   builds only that variant's weights.
2. AttnRes: a tiny K3 model (dense fp32 experts, so the reference MXFP4 decode does not dominate) run with Block
   AttnRes and, with the same weights, with plain residuals; prefill and decode-step times (best of interleaved runs),
   and the time spent inside the AttnRes mixes.

Usage: python scripts/bench_k3.py [--experts 64 --top-k 8 --latent 896 --inter 768 --tokens 1,16,256]
                                  [--hidden 512 --layers 8 --prefill 512 --decode-steps 16] [--skip-experts|attnres]
Prints medians and ratios; record results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (and first-call allocations)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def random_mxfp4(experts: int, rows: int, cols: int, g: torch.Generator):
    """Random MXFP4 experts (any byte is a valid pair of codes; scales near 2**-6, the size of trained weights)."""
    from deltaserve.ops.mxfp4 import MXFP4Tensor

    packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
    return MXFP4Tensor(packed, torch.randint(118, 124, (experts, rows, cols // 32), generator=g, dtype=torch.uint8))


def dense_copy(w, dtype: torch.dtype) -> torch.Tensor:
    """The same experts decoded to `dtype`, one expert at a time (no full-size temporaries)."""
    from deltaserve.ops.mxfp4 import mxfp4_dequantize

    out = torch.empty(*w.shape, dtype=dtype)
    for e in range(w.packed.shape[0]):
        out[e] = mxfp4_dequantize(w.packed[e], w.scale[e], dtype)
    return out


def expert_inputs(args: argparse.Namespace, tokens: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(tokens)])
    return torch.randn(tokens, args.latent, generator=g), ids, torch.rand(tokens, args.top_k, generator=g)


def expert_variants(args: argparse.Namespace, names: list[str]) -> dict:
    """name -> (w13, w2, linear, activation dtype) for the same random experts."""
    from deltaserve.ops.mxfp4 import mxfp4_linear

    g = torch.Generator().manual_seed(0)
    w13, w2 = random_mxfp4(args.experts, 2 * args.inter, args.latent, g), random_mxfp4(
        args.experts, args.latent, args.inter, g)
    out = {}
    for name in names:
        dtype = torch.float32 if name.endswith("fp32") else torch.bfloat16
        if name.startswith("dense"):
            out[name] = (dense_copy(w13, dtype), dense_copy(w2, dtype), F.linear, dtype)
        else:
            out[name] = (w13, w2, partial(mxfp4_linear, mxfp8_activations="mxfp8" in name), dtype)
    return out


def expert_step(variant, z, ids, weights):
    from deltaserve.ops.activation import situ_and_mul
    from deltaserve.ops.moe import moe_experts

    w13, w2, linear, dtype = variant
    act = partial(situ_and_mul, beta=4.0, linear_beta=25.0, interleaved=True)
    return lambda: moe_experts(z.to(dtype), w13, w2, weights, ids, act=act, linear=linear, fp32_combine=True)


def expert_memory_worker(args: argparse.Namespace) -> dict:
    """In its own process: RSS before and after building one variant's weights, and the peak while running it."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    inputs = [expert_inputs(args, n, g) for n in args.tokens]
    base = rss_mib()
    variant = expert_variants(args, [args.variant])[args.variant]
    w13, w2 = variant[0], variant[1]
    tensors = (w13, w2) if isinstance(w13, torch.Tensor) else (w13.packed, w13.scale, w2.packed, w2.scale)
    built = rss_mib()
    for z, ids, weights in inputs:
        expert_step(variant, z, ids, weights)()
    return {"weight_mib": sum(t.numel() * t.element_size() for t in tensors) / 2**20, "build_mib": built - base,
            "run_growth_mib": rss_mib() - built}


VARIANTS = ["dense-bf16", "mxfp4-bf16", "mxfp4-mxfp8-bf16", "dense-fp32", "mxfp4-fp32"]


def bench_experts(args: argparse.Namespace) -> None:
    base = [sys.executable, __file__, "--worker", "--experts", str(args.experts), "--top-k", str(args.top_k),
            "--latent", str(args.latent), "--inter", str(args.inter), "--tokens", ",".join(map(str, args.tokens)),
            "--threads", str(args.threads)]
    memory = {}
    for name in VARIANTS:  # dense variants are built from the decoded MXFP4 experts (no full-size temporaries)
        proc = subprocess.run([*base, "--variant", name], capture_output=True, text=True, check=True)
        memory[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    torch.set_num_threads(args.threads)
    variants = expert_variants(args, VARIANTS)
    g = torch.Generator().manual_seed(1)
    print(f"\nrouted experts: E={args.experts}, top-{args.top_k}, latent {args.latent}, expert width {args.inter}, "
          f"{args.threads} thread(s); ms = median of {args.repeats} interleaved runs")
    for name in VARIANTS:
        m = memory[name]
        print(f"  {name:17s} weights {m['weight_mib']:7.2f} MiB | RSS after build +{m['build_mib']:6.1f} MiB | "
              f"RSS growth while running +{m['run_growth_mib']:5.1f} MiB")
    print("  tokens | " + " | ".join(f"{n:>16s}" for n in VARIANTS) + " | mxfp4/dense bf16 | mxfp4/dense fp32")
    for tokens in args.tokens:
        z, ids, weights = expert_inputs(args, tokens, g)
        steps = {n: expert_step(variants[n], z, ids, weights) for n in VARIANTS}
        for fn in steps.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {n: [] for n in VARIANTS}
        for _ in range(args.repeats):
            for n, fn in steps.items():
                start = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - start)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"  {tokens:6d} | " + " | ".join(f"{ms[n]:13.2f} ms" for n in VARIANTS)
              + f" | {ms['mxfp4-bf16'] / ms['dense-bf16']:15.2f}x | {ms['mxfp4-fp32'] / ms['dense-fp32']:15.2f}x")


def bench_attn_res(args: argparse.Namespace) -> None:
    import dataclasses

    import deltaserve.layers.attn_res as attn_res_layer
    from deltaserve.models.kimi_k3 import KimiK3ForConditionalGeneration
    from deltaserve.models.loader import load_model
    from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint
    from deltaserve.runner.model_runner import ModelRunner
    from deltaserve.scheduler.output import ScheduledChunk

    torch.set_num_threads(args.threads)
    spec = TinySpec(arch="kimi_k3", hidden=args.hidden, layers=args.layers, latent_size=args.hidden // 2,
                    moe_intermediate=args.hidden // 2, intermediate=2 * args.hidden, q_lora_rank=96, shared_experts=2,
                    routed_scaling_factor=1.0, experts=16, top_k=4, attn_res_block_size=3, expert_format="dense")
    with_res = load_model(write_tiny_checkpoint(tempfile.mkdtemp(prefix="ds-k3-"), spec), dtype=torch.float32)
    # The same weights without AttnRes: plain residuals (the AttnRes pseudo-queries are simply not used).
    plain = KimiK3ForConditionalGeneration(dataclasses.replace(with_res.config, attn_res_block_size=None))
    plain.load_state_dict(with_res.state_dict(), strict=False)
    models = {"plain": plain.eval(), "attn_res": with_res}
    mix_seconds = [0.0]
    timed_mix = attn_res_layer.attn_res_mix

    def counting_mix(*a, **kw):
        start = time.perf_counter()
        out = timed_mix(*a, **kw)
        mix_seconds[0] += time.perf_counter() - start
        return out

    attn_res_layer.attn_res_mix = counting_mix
    ids = torch.randint(0, 990, (args.prefill,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(-(-(args.prefill + args.decode_steps + 1) // 16)))

    def runs(model):
        runner = ModelRunner(model, num_blocks=len(blocks), block_size=16, num_slots=1)
        prefill = ScheduledChunk(request_id="r", new_token_ids=ids, num_computed_tokens=0, state_slot=0,
                                 block_ids=blocks, reset_state=True)

        def run() -> tuple[float, float, float, float]:
            """(prefill s, its mix s, mean decode step s, its mix s)"""
            mix_seconds[0] = 0.0
            start = time.perf_counter()
            runner.execute_model([prefill])
            pre, pre_mix = time.perf_counter() - start, mix_seconds[0]
            mix_seconds[0] = 0.0
            start = time.perf_counter()
            for n in range(args.decode_steps):
                runner.execute_model([ScheduledChunk(request_id="r", new_token_ids=[ids[n]],
                                                     num_computed_tokens=len(ids) + n, state_slot=0,
                                                     block_ids=blocks)])
            dec = (time.perf_counter() - start) / args.decode_steps
            return pre, pre_mix, dec, mix_seconds[0] / args.decode_steps
        return run

    fns = {name: runs(m) for name, m in models.items()}
    for fn in fns.values():
        fn()  # warm-up
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in models}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for name, fn in fns.items():
            results[name].append(fn())
    # Minimum over interleaved runs: on a shared machine the least-disturbed run is the best estimate of each.
    med = {name: [min(col) * 1e3 for col in zip(*rows, strict=True)] for name, rows in results.items()}
    print(f"\nBlock AttnRes: tiny K3, hidden {args.hidden}, {args.layers} layers, blocks of 3 layers, dense fp32 "
          f"experts, {args.threads} thread(s); best of {args.repeats} interleaved runs, same weights")
    for col, what in ((0, f"prefill {args.prefill} tokens"), (2, "decode step (1 sequence)")):
        p, r, mix = med["plain"][col], med["attn_res"][col], med["attn_res"][col + 1]
        print(f"  {what:26s} plain {p:8.2f} ms | attn_res {r:8.2f} ms ({100 * (r / p - 1):+.1f}%) | "
              f"time inside the {2 * args.layers + 1} mixes {mix:7.2f} ms ({100 * mix / r:.1f}% of the forward)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--latent", type=int, default=896, help="K3: 3584 (scaled down 4x by default)")
    parser.add_argument("--inter", type=int, default=768, help="K3: 3072 (scaled down 4x by default)")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 256])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-experts", action="store_true")
    parser.add_argument("--skip-attnres", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="dense-bf16", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(expert_memory_worker(args)))
        return
    if not args.skip_experts:
        bench_experts(args)
    if not args.skip_attnres:
        bench_attn_res(args)


if __name__ == "__main__":
    main()
