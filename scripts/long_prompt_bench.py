"""Prefill time and peak resident memory of one long prompt against its length, on a tiny checkpoint (CPU).

Each length runs in a fresh process (so its peak RSS is its own): a random prompt of L tokens is prefilled in chunks
of --chunk tokens (`max_num_batched_tokens`) through `EngineCore`, then one token is sampled. Prints, per length, the
prefill seconds, microseconds per prompt token, the peak RSS and the time inside MLA / KDA / FFN modules, and at the
end the ratio between the last and the first per-token cost.

    python scripts/long_prompt_bench.py --lengths 4096,16384,65536 --chunk 8192 --threads 2
    python scripts/long_prompt_bench.py --spec long-context --lengths 4096,65536,1048576 --chunk 65536
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.executor.uniproc import UniprocExecutor
from deltaserve.models.tiny import write_tiny_checkpoint
from deltaserve.models.tiny_spec import LONG_CONTEXT, TinySpec
from deltaserve.sampling_params import SamplingParams

SPECS = {"default": TinySpec(), "long-context": LONG_CONTEXT}


def make_checkpoint(out: Path, max_len: int, spec: TinySpec) -> Path:
    """A tiny checkpoint of `spec` (default `make-tiny`: hidden 256, 8 layers) with `model_max_length` raised to
    `max_len`."""
    write_tiny_checkpoint(out, spec)
    cfg_path = out / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["model_max_length"] = max_len
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
    return out


def measure(model: str, length: int, chunk: int, threads: int) -> dict[str, Any]:
    """Prefill one random prompt of `length` tokens in chunks of `chunk`; seconds, peak RSS and module times."""
    torch.set_num_threads(threads)
    cfg = EngineConfig(model=model, max_model_len=length + 16, num_threads=threads,
                       # The KV cache sized for the prompt (so the peak RSS shows what the context needs), one
                       # state slot; prefix caching on, as served (its checkpoints every 512 tokens are measured).
                       cache=CacheConfig(num_blocks=length // 16 + 8, num_state_slots=1),
                       scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=1))
    core = EngineCore(cfg)
    assert isinstance(core.executor, UniprocExecutor)
    inside: dict[str, float] = collections.defaultdict(float)
    started: dict[int, float] = {}
    target: Any = core.executor.worker.model
    for layer in target.decoder_layers:
        for mod in (layer.self_attn, layer.mlp):
            kind = type(mod).__name__
            mod.register_forward_pre_hook(lambda m, a: started.__setitem__(id(m), time.perf_counter()))
            mod.register_forward_hook(lambda m, a, o, kind=kind: inside.__setitem__(
                kind, inside[kind] + time.perf_counter() - started[id(m)]))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, core.model_config.vocab_size - 32, (length,), generator=gen).tolist()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    core.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    steps, token = 0, None
    while token is None:
        for out in core.step():
            token = out.new_token_ids[0] if out.new_token_ids else token
        steps += 1
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    core.shutdown()
    return {"length": length, "chunk": chunk, "steps": steps, "seconds": seconds,
            "us_per_token": 1e6 * seconds / length, "peak_rss_mib": peak / 1024, "rss_before_mib": rss_before / 1024,
            "token": token,
            "modules_s": {k: round(v, 2) for k, v in sorted(inside.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny one of --spec, length raised)")
    ap.add_argument("--spec", choices=sorted(SPECS), default="default",
                    help="the tiny checkpoint: make-tiny's default, or long-context (one MLA layer of one head)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process: one length
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.model, args.one, args.chunk, args.threads)), flush=True)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_checkpoint(Path(tmp) / "tiny", max(lengths) + 1024,
                                                       SPECS[args.spec]))
        first = None
        for length in lengths:
            cmd = [sys.executable, __file__, "--one", str(length), "--chunk", str(args.chunk),
                   "--threads", str(args.threads), "--model", model]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            first = first or r["us_per_token"]
            print(f"{length:8d} tokens, chunk {args.chunk}: {r['seconds']:8.1f} s, {r['us_per_token']:7.1f} us/token "
                  f"({r['us_per_token'] / first:.2f}x first), peak RSS {r['peak_rss_mib']:7.0f} MiB "
                  f"(after load {r['rss_before_mib']:.0f}), modules {r['modules_s']}", flush=True)


if __name__ == "__main__":
    main()
