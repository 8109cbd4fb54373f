"""`deltaserve bench replay`: prefix caching measured through the offline engine on a Mooncake trace.

Plays a scaled-down Mooncake conversation trace with prefix caching on and off and reports the hit rate against
the trace's theoretical maximum and TTFT p50/p90.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import islice, takewhile
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` block in the Mooncake traces."""
# The repository's checkout sits beside the project's shared/ folder.
DEFAULT_TRACE = str(Path(__file__).resolve().parents[3] / "shared/data/traces/mooncake-fast25/conversation_trace.jsonl")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayBenchArgs:
    """Workload of the trace replay."""

    model: str | None = None
    """Checkpoint directory (default: write the default tiny checkpoint to a temporary directory)."""
    trace: str = DEFAULT_TRACE
    """Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids of 512-token blocks)."""
    select: str = "sessions"
    """'head': the first num_requests lines; 'sessions': the first num_requests requests of conversations (requests
    linked by a >= 2-block shared prefix), in trace order. The head of the trace reuses little more than the shared
    system block: a follow-up turn comes a median ~420 requests after the turn it extends."""
    num_requests: int = 40
    """Requests to replay."""
    token_scale: int = 16
    """Divide input and output lengths by this (a divisor of 512): 512-token trace blocks become 512/token_scale."""
    time_scale: float = 1.0
    """Compress arrival times by this factor (2 = twice as fast); idle gaps of the engine are skipped anyway."""
    max_output_len: int = 32
    """Cap on the scaled output length of a request."""
    seed: int = 0
    """Seed of the token ids that stand for each trace block."""
    block_size: int = 16
    """Engine KV block size (tokens)."""
    state_checkpoint_interval: int | None = None
    """Engine KDA checkpoint interval (default: the scaled trace block, rounded up to a multiple of block_size)."""
    cache_memory: str = "2GiB"
    """Engine cache memory (KV blocks, state slots and checkpoints)."""
    max_num_batched_tokens: int = 2048
    """Engine per-step token budget."""
    max_num_seqs: int = 64
    """Engine cap on running requests."""
    dtype: str = "float32"
    """'float32' or 'bfloat16'."""
    baseline: bool = True
    """Also replay with prefix caching off and compare TTFTs."""
    host_cache_memory: str | None = None
    """Also replay with a host tier (L2) of this size behind the device cache (`--host-cache-memory`)."""
    shared_cache_url: str | None = None
    """Also replay with the host tier and this shared store (L3) behind it (`--shared-cache-url`; a running Redis or
    Mooncake Store, which should start empty)."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        if self.token_scale < 1 or TRACE_BLOCK_TOKENS % self.token_scale:
            raise ValueError(f"token_scale must divide {TRACE_BLOCK_TOKENS}, got {self.token_scale}")
        if self.select not in ("head", "sessions"):
            raise ValueError(f"select={self.select!r} is not supported (supported: 'head', 'sessions')")
        if self.num_requests < 1 or self.time_scale <= 0 or self.max_output_len < 1:
            raise ValueError("num_requests and max_output_len must be >= 1 and time_scale > 0")

    @property
    def block_tokens(self) -> int:
        """Tokens per scaled trace block."""
        return TRACE_BLOCK_TOKENS // self.token_scale


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One trace line after scaling."""

    arrival_s: float
    """Seconds after the first selected request, divided by time_scale."""
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    """Ids of the scaled blocks, ceil(input_len / block_tokens) of them; equal leading ids = equal prefixes."""


def read_trace(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` (default: all) rows of a JSONL trace."""
    with open(path) as f:
        return [json.loads(line) for line in islice((line for line in f if line.strip()), limit)]


def _chains(hash_ids: tuple[int, ...] | list[int]) -> list[tuple[int, ...]]:
    return [tuple(hash_ids[: n + 1]) for n in range(len(hash_ids))]


def select_sessions(rows: list[dict[str, Any]], num_requests: int, min_shared_blocks: int = 2) -> list[dict[str, Any]]:
    """The first `num_requests` requests of multi-request conversations, in trace order.

    A request joins the conversation of the earliest request holding its longest previously seen block chain when
    that chain is at least `min_shared_blocks` long (block 0 alone is the system prompt that every request shares).
    Conversations are taken whole, by their first request, until `num_requests` are collected.
    """
    owner: dict[tuple[int, ...], int] = {}
    session = list(range(len(rows)))
    for i, row in enumerate(rows):
        chains = _chains(row["hash_ids"])
        seen = list(takewhile(owner.__contains__, chains))
        if len(seen) >= min_shared_blocks:
            session[i] = session[owner[seen[-1]]]
        for c in chains:
            owner.setdefault(c, i)
    members: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(session):
        members[s].append(i)
    chosen: list[int] = []
    for s in sorted(members):
        if len(members[s]) >= 2 and len(chosen) < num_requests:
            chosen += members[s][: num_requests - len(chosen)]
    return [rows[i] for i in sorted(chosen)]


def scale_trace(rows: list[dict[str, Any]], *, token_scale: int, time_scale: float, max_output_len: int,
                max_model_len: int) -> list[TraceRequest]:
    """Lengths divided by `token_scale` (rounded up, so the block count is kept), arrivals by `time_scale`.

    Outputs are capped at `max_output_len`; a prompt is cut to `max_model_len - output_len` with its block ids.
    """
    if max_output_len >= max_model_len:
        raise ValueError(f"max_output_len={max_output_len} leaves no room for a prompt in {max_model_len} tokens")
    block_tokens = TRACE_BLOCK_TOKENS // token_scale
    start_ms = rows[0]["timestamp"] if rows else 0
    out = []
    for row in rows:
        if len(row["hash_ids"]) * TRACE_BLOCK_TOKENS < row["input_length"]:
            raise ValueError(f"trace row at {row['timestamp']} ms: too few hash_ids for {row['input_length']} tokens")
        output_len = max(1, min(-(-row["output_length"] // token_scale), max_output_len))
        input_len = max(1, min(-(-row["input_length"] // token_scale), max_model_len - output_len))
        out.append(TraceRequest(
            arrival_s=(row["timestamp"] - start_ms) / 1000 / time_scale, input_len=input_len, output_len=output_len,
            hash_ids=tuple(row["hash_ids"][: -(-input_len // block_tokens)]),
        ))
    return out


def theoretical_hits(requests: list[TraceRequest], block_tokens: int) -> list[int]:
    """Per request, the prompt tokens an infinite prefix cache could serve, replaying the requests in order.

    That is the longest leading block chain an earlier request had (counting only the tokens that request really
    had, for a partial last block), leaving at least one prompt token to compute.
    """
    covered: dict[tuple[int, ...], int] = {}  # chain -> most of its tokens that any earlier prompt contained
    hits = []
    for r in requests:
        chains = _chains(r.hash_ids)
        hit = max((covered[c] for c in takewhile(covered.__contains__, chains)), default=0)
        hits.append(max(0, min(hit, r.input_len - 1)))
        for n, c in enumerate(chains, start=1):
            covered[c] = max(covered.get(c, 0), min(n * block_tokens, r.input_len))
    return hits


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """The fixed tokens that stand for trace block `hash_id`: same (id, seed) -> same tokens; below special tokens."""
    rng = random.Random(f"{seed}:{hash_id}")
    return [rng.randrange(vocab_size - 32) for _ in range(block_tokens)]


def build_prompts(requests: list[TraceRequest], block_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Each prompt: the tokens of its blocks, concatenated and cut to input_len (the last block may be partial)."""
    blocks: dict[int, list[int]] = {}
    prompts = []
    for r in requests:
        ids: list[int] = []
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = block_token_ids(h, block_tokens, vocab_size, seed)
            ids += blocks[h]
        prompts.append(ids[: r.input_len])
    return prompts


def make_llm(model: str, *, caching: bool, checkpoint_interval: int, **engine_args: Any):
    """A fresh LLM with prefix caching on or off, after one short warm-up request (one-time setup costs)."""
    from deltaserve.entrypoints.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    llm = LLM(model=model, enable_prefix_caching=caching, state_checkpoint_interval=checkpoint_interval, **engine_args)
    warm = random.Random(-1)
    llm.generate([[warm.randrange(llm.engine.model_config.vocab_size - 32) for _ in range(16)]],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    return llm


def prefix_stats(llm) -> dict[str, int] | None:
    """The cache manager's prefix-cache counters (`PrefixCacheStats` as a dict), or None when it has none."""
    get = getattr(llm.engine.cache, "prefix_stats", None)
    return None if get is None else asdict(get())


@dataclass(slots=True)
class _Timing:
    arrival: float
    """perf_counter time at which the request arrived (idle gaps skipped)."""
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0

    def latencies_ms(self) -> tuple[float, float]:
        """(TTFT, end-to-end latency) in ms of a finished request."""
        if self.first_token is None or self.finished is None:
            raise ValueError("the request has not finished")
        return (self.first_token - self.arrival) * 1000, (self.finished - self.arrival) * 1000


def replay(llm, requests: list[TraceRequest], prompts: list[list[int]], label: str = "") -> dict[str, Any]:
    """Feed the requests at their arrival times and step the engine until all finish.

    A request that arrives during a step is added after it; its TTFT counts from its arrival, as a client's would.
    When the engine is idle the clock jumps to the next arrival instead of sleeping.
    """
    from deltaserve.sampling_params import SamplingParams

    eng = llm.engine
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    timings: dict[str, _Timing] = {}
    start = time.perf_counter()
    skipped, nxt, done = 0.0, 0, 0
    while nxt < len(order) or eng.has_unfinished_requests():
        clock = time.perf_counter() - start + skipped
        if not eng.has_unfinished_requests():
            skipped += max(0.0, requests[order[nxt]].arrival_s - clock)
            clock = max(clock, requests[order[nxt]].arrival_s)
        while nxt < len(order) and requests[order[nxt]].arrival_s <= clock:
            r = requests[order[nxt]]
            timings[str(order[nxt])] = _Timing(arrival=start + r.arrival_s - skipped)
            eng.add_request(str(order[nxt]), prompts[order[nxt]],
                            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
            nxt += 1
        events = eng.step()
        now = time.perf_counter()
        for ev in events:
            t = timings[ev.request_id]
            if t.first_token is None:
                t.first_token, t.cached_tokens = now, getattr(ev, "num_cached_tokens", 0)
            if ev.finish_reason is not None:
                t.finished, done = now, done + 1
                if done % 10 == 0 or done == len(requests):
                    print(f"  [{label}] {done}/{len(requests)} finished, {now - start:.1f} s", flush=True)
    ordered = [timings[str(i)] for i in range(len(requests))]
    return _summarize(llm, requests, ordered, time.perf_counter() - start)


def _summarize(llm, requests: list[TraceRequest], timings: list[_Timing], seconds: float) -> dict[str, Any]:
    import numpy as np

    latencies = [t.latencies_ms() for t in timings]
    ttft_ms = [ttft for ttft, _ in latencies]
    prompt_tokens = sum(r.input_len for r in requests)
    hit = sum(t.cached_tokens for t in timings)
    return {
        "seconds": seconds, "prompt_tokens": prompt_tokens, "hit_tokens": hit, "hit_rate": hit / prompt_tokens,
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)), "ttft_p90_ms": float(np.percentile(ttft_ms, 90)),
        "mean_ttft_ms": float(np.mean(ttft_ms)),
        "mean_e2el_ms": float(np.mean([e2el for _, e2el in latencies])),
        "prefix_stats": prefix_stats(llm), "ttfts_ms": ttft_ms, "cached_tokens": [t.cached_tokens for t in timings],
    }


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells))


def _model_and_limits(model: str | None) -> tuple[str, int, int]:
    from deltaserve.config import ModelConfig
    from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint

    model = model or str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="ds-bench-"), TinySpec()))
    cfg = ModelConfig.from_pretrained(model)
    return model, cfg.vocab_size, cfg.max_model_len


def load_requests(args: ReplayBenchArgs, max_model_len: int) -> list[TraceRequest]:
    """The selected trace rows, scaled."""
    if args.select == "head":
        rows = read_trace(args.trace, args.num_requests)
    else:
        rows = select_sessions(read_trace(args.trace), args.num_requests)
    return scale_trace(rows, token_scale=args.token_scale, time_scale=args.time_scale,
                       max_output_len=args.max_output_len, max_model_len=max_model_len)


def run(args: ReplayBenchArgs) -> dict:
    model, vocab, max_model_len = _model_and_limits(args.model)
    requests = load_requests(args, max_model_len)
    prompts = build_prompts(requests, args.block_tokens, vocab, args.seed)
    max_hits = theoretical_hits(requests, args.block_tokens)
    prompt_tokens = sum(r.input_len for r in requests)
    interval = args.state_checkpoint_interval or math.lcm(args.block_tokens, args.block_size)
    trace = {"num_requests": len(requests), "prompt_tokens": prompt_tokens,
             "output_tokens": sum(r.output_len for r in requests), "block_tokens": args.block_tokens,
             "span_s": max(r.arrival_s for r in requests), "theoretical_hit_tokens": sum(max_hits),
             "theoretical_hit_rate": sum(max_hits) / prompt_tokens, "state_checkpoint_interval": interval}
    print(f"trace replay: {len(requests)} requests ({args.select}) of {args.trace}, {prompt_tokens} prompt / "
          f"{trace['output_tokens']} output tokens, {args.block_tokens}-token blocks, arrivals over "
          f"{trace['span_s']:.1f} s, checkpoint {model}", flush=True)
    engine_args = dict(dtype=args.dtype, block_size=args.block_size, cache_memory=args.cache_memory,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    result: dict[str, Any] = {"config": asdict(args), "trace": trace}
    runs: list[tuple[str, bool, str | None]] = [("caching_on", True, None)]
    if args.host_cache_memory is not None:
        runs.append(("caching_on_host", True, args.host_cache_memory))
        if args.shared_cache_url is not None:
            runs.append(("caching_on_shared", True, args.host_cache_memory))
    if args.baseline:
        runs.append(("caching_off", False, None))
    for key, caching, host in runs:
        print(f"replaying: {key.replace('_', ' ')} ...", flush=True)
        extra: dict[str, str] = {} if host is None else {"host_cache_memory": host}
        if key == "caching_on_shared" and args.shared_cache_url is not None:
            extra["shared_cache_url"] = args.shared_cache_url
        llm = make_llm(model, caching=caching, checkpoint_interval=interval, **engine_args, **extra)
        result[key] = replay(llm, requests, prompts, label=key)
        del llm
    on = result["caching_on"]
    result["hit_rate_vs_theoretical"] = on["hit_tokens"] / max(1, trace["theoretical_hit_tokens"])
    _print_replay(result)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print_replay(result: dict[str, Any]) -> None:
    runs = [k for k in ("caching_on", "caching_on_host", "caching_on_shared", "caching_off") if k in result]
    trace = result["trace"]
    rows = [
        ("hit tokens", *(str(result[k]["hit_tokens"]) for k in runs), str(trace["theoretical_hit_tokens"])),
        ("hit rate", *(f"{result[k]['hit_rate']:.1%}" for k in runs), f"{trace['theoretical_hit_rate']:.1%}"),
        ("TTFT p50 (ms)", *(f"{result[k]['ttft_p50_ms']:.0f}" for k in runs), ""),
        ("TTFT p90 (ms)", *(f"{result[k]['ttft_p90_ms']:.0f}" for k in runs), ""),
        ("mean E2EL (ms)", *(f"{result[k]['mean_e2el_ms']:.0f}" for k in runs), ""),
        ("wall time (s)", *(f"{result[k]['seconds']:.1f}" for k in runs), ""),
    ]
    _print_table(("", *(k.replace("_", " ") for k in runs), "theoretical max"), rows)
    print(f"hit tokens / theoretical max: {result['hit_rate_vs_theoretical']:.1%}")
    stats = result["caching_on"]["prefix_stats"]
    print(f"prefix_stats (caching on, warm-up request included): {stats if stats is not None else 'not available'}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `replay` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("replay", help="replay the Mooncake conversation trace, prefix caching on vs off")
    add_dataclass_args(p, ReplayBenchArgs)
    p.set_defaults(func=lambda a: (run(dataclass_from_args(ReplayBenchArgs, a)), 0)[1])
