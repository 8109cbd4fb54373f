"""`deltaserve bench followup`: TTFT of a request that shares most of an already cached prompt, warm vs cold."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from deltaserve.bench.trace_replay import _model_and_limits, _print_table, make_llm, prefix_stats


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowupBenchArgs:
    """Workload of the follow-up benchmark."""

    model: str | None = None
    """Checkpoint directory (default: write the default tiny checkpoint to a temporary directory)."""
    prompt_len: int = 4000
    """Tokens of the first prompt and of the follow-up (prompt_len + output_len must fit max_model_len)."""
    shared: float = 0.9
    """Fraction of the first prompt that the follow-up repeats; the rest of it is a new tail."""
    output_len: int = 8
    """Generated tokens per request."""
    state_checkpoint_interval: int = 256
    """Engine KDA checkpoint interval: the follow-up can resume from the last checkpoint inside the shared part."""
    block_size: int = 16
    """Engine KV block size (tokens)."""
    cache_memory: str = "2GiB"
    """Engine cache memory."""
    max_num_batched_tokens: int = 2048
    """Engine per-step token budget."""
    dtype: str = "float32"
    """'float32' or 'bfloat16'."""
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    seed: int = 0
    """Seed of the random prompts."""
    target: float = 0.15
    """Pass when warm TTFT / cold TTFT is at most this."""
    evict_tokens: int = 0
    """Run this many tokens of other prompts between the first prompt and the follow-up (with a small
    `num_blocks`, they evict the first prompt from the device cache). The follow-up is then measured twice: with
    the host tier (`host_cache_memory`: rehydrated) and without (recomputed); the ratio is theirs."""
    num_blocks: int | None = None
    """Engine KV blocks on the device (default: sized from cache_memory)."""
    host_cache_memory: str | None = None
    """Host tier (L2) size for the rehydration run (with evict_tokens)."""
    compare_copy_overlap: bool = False
    """With evict_tokens: rehydrate twice more, with the host tier's copies beside the forward, layer by layer
    (`DELTASERVE_HOST_COPY_OVERLAP=1`), and all before it (`0`), and report the two TTFTs' ratio."""
    result_file: str | None = None
    """Write the results as JSON here."""


def _time_request(llm, request_id: str, prompt: list[int], output_len: int) -> dict[str, float]:
    """Run one request alone to completion; TTFT and E2EL in seconds, cached tokens from its first output."""
    from deltaserve.sampling_params import SamplingParams

    eng = llm.engine
    start = time.perf_counter()
    eng.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    out: dict[str, float] = {}
    while eng.has_unfinished_requests():
        for ev in eng.step():
            if "ttft_s" not in out:
                out.update(ttft_s=time.perf_counter() - start, cached_tokens=getattr(ev, "num_cached_tokens", 0))
    out["e2el_s"] = time.perf_counter() - start
    return out


def run_followup(args: FollowupBenchArgs) -> dict:
    model, vocab, max_model_len = _model_and_limits(args.model)
    if args.prompt_len + args.output_len > max_model_len or not 0 < args.shared < 1:
        raise ValueError(f"need prompt_len + output_len <= max_model_len ({max_model_len}) and 0 < shared < 1")
    rng = random.Random(args.seed)
    num_shared = int(args.prompt_len * args.shared)
    first = [rng.randrange(vocab - 32) for _ in range(args.prompt_len)]
    followup = first[:num_shared] + [rng.randrange(vocab - 32) for _ in range(args.prompt_len - num_shared)]
    reusable = num_shared // args.state_checkpoint_interval * args.state_checkpoint_interval
    print(f"follow-up benchmark: {args.prompt_len}-token prompt, follow-up shares {num_shared} tokens "
          f"(last checkpoint inside: {reusable}), {args.output_len} output tokens, checkpoint {model}", flush=True)
    engine_args = dict(dtype=args.dtype, device=args.device, block_size=args.block_size,
                       cache_memory=args.cache_memory, max_num_batched_tokens=args.max_num_batched_tokens)
    print("cold: follow-up alone on a fresh engine ...", flush=True)
    llm = make_llm(model, caching=True, checkpoint_interval=args.state_checkpoint_interval, **engine_args)
    cold = _time_request(llm, "followup", followup, args.output_len)
    del llm
    if args.num_blocks is not None:
        engine_args["num_blocks"] = args.num_blocks
    if args.evict_tokens:
        return _evicted_followup(args, model, first, followup, cold, engine_args)
    print("warm: first prompt, then the follow-up ...", flush=True)
    llm = make_llm(model, caching=True, checkpoint_interval=args.state_checkpoint_interval, **engine_args)
    first_run = _time_request(llm, "first", first, args.output_len)
    warm = _time_request(llm, "followup", followup, args.output_len)
    ratio = warm["ttft_s"] / cold["ttft_s"]
    result = {"config": asdict(args), "num_shared_tokens": num_shared, "reusable_tokens": reusable,
              "cold": cold, "first": first_run, "warm": warm, "ttft_ratio": ratio, "passed": ratio <= args.target,
              "prefix_stats": prefix_stats(llm)}
    _print_table(("", "TTFT (ms)", "cached tokens"), [
        (name, f"{r['ttft_s'] * 1000:.0f}", str(r["cached_tokens"]))
        for name, r in (("first prompt", first_run), ("follow-up, cold", cold), ("follow-up, warm", warm))])
    print(f"warm / cold TTFT: {ratio:.1%} (target <= {args.target:.0%}: {'PASS' if result['passed'] else 'FAIL'})")
    print(f"prefix_stats (warm engine): {result['prefix_stats'] or 'not available'}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _evicted_followup(args: FollowupBenchArgs, model: str, first: list[int], followup: list[int],
                      cold: dict[str, float], engine_args: dict) -> dict:
    """First prompt, `evict_tokens` of other prompts, then the follow-up: on an engine without a host tier (the
    follow-up recomputes what was evicted) and on one with it (rehydrated from host memory)."""
    rng = random.Random(args.seed + 1)
    vocab = max(first) + 32
    fillers = [[rng.randrange(vocab - 32) for _ in range(1000)] for _ in range(-(-args.evict_tokens // 1000))]
    runs: dict[str, dict] = {}
    modes: list[tuple[str, str | None, str | None]] = [("recomputed", None, None),
                                                       ("rehydrated", args.host_cache_memory, None)]
    if args.compare_copy_overlap:
        modes += [("rehydrated, copies beside the forward", args.host_cache_memory, "1"),
                  ("rehydrated, copies before the forward", args.host_cache_memory, "0")]
    for name, host, overlap in modes:
        print(f"{name}: first prompt, {len(fillers)} x 1,000 tokens of other prompts, then the follow-up ...",
              flush=True)
        extra: dict[str, str] = {} if host is None else {"host_cache_memory": host}
        with _environment("DELTASERVE_HOST_COPY_OVERLAP", overlap):  # read when the engine's worker starts
            llm = make_llm(model, caching=True, checkpoint_interval=args.state_checkpoint_interval, **engine_args,
                           **extra)
        _time_request(llm, "first", first, args.output_len)
        for i, prompt in enumerate(fillers):
            _time_request(llm, f"filler-{i}", prompt, 1)
        copy_s = llm.engine.get_stats().host_copy_seconds
        runs[name] = _time_request(llm, "followup", followup, args.output_len)
        runs[name]["host_copy_s"] = llm.engine.get_stats().host_copy_seconds - copy_s
        runs[name]["prefix_stats"] = prefix_stats(llm)
        del llm
    ratio = runs["rehydrated"]["ttft_s"] / runs["recomputed"]["ttft_s"]
    result = {"config": asdict(args), "cold": cold, **runs, "ttft_ratio": ratio, "passed": ratio <= args.target}
    _print_table(("", "TTFT (ms)", "cached tokens", "host-tier copies (ms)"), [
        (name, f"{r['ttft_s'] * 1000:.0f}", str(r["cached_tokens"]), f"{r.get('host_copy_s', 0) * 1000:.1f}")
        for name, r in (("follow-up, cold", cold), *((f"evicted, {k}", v) for k, v in runs.items()))])
    print(f"rehydrated / recomputed TTFT: {ratio:.1%} (target <= {args.target:.0%}: "
          f"{'PASS' if result['passed'] else 'FAIL'})")
    if args.compare_copy_overlap:
        result["overlap_ratio"] = (runs["rehydrated, copies beside the forward"]["ttft_s"]
                                   / runs["rehydrated, copies before the forward"]["ttft_s"])
        print(f"rehydrated TTFT, copies beside / before the forward: {result['overlap_ratio']:.2f}x")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """`name=value` in this process's environment for the block (an engine reads its settings when it starts);
    None: as it is."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `followup` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("followup", help="TTFT of a follow-up sharing 90%% of a cached prompt, vs cold")
    add_dataclass_args(p, FollowupBenchArgs)
    p.set_defaults(func=lambda a: (run_followup(dataclass_from_args(FollowupBenchArgs, a)), 0)[1])
