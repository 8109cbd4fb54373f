"""`deltaserve bench http`: what the HTTP path adds over the engine, on the same requests and checkpoint.

Side by side: (1) the requests added to an in-process `EngineCore` at once and stepped to completion (TTFT =
first token out of `step()`); (2) the same requests as concurrent streaming POST /v1/completions (token-id
prompts, so tokenisation is identical) to a `deltaserve serve` process started here (TTFT = first SSE event
with text at the client). Prints requests/s and TTFT of both and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpBenchArgs:
    """Workload of the HTTP overhead benchmark."""

    model: str | None = None
    """Checkpoint directory (default: write the default tiny checkpoint to a temporary directory)."""
    num_requests: int = 64
    """Concurrent streaming requests."""
    input_len: int = 32
    """Prompt tokens per request."""
    output_len: int = 16
    """Generated tokens per request (eos ignored)."""
    seed: int = 0
    """Seed of the random prompts."""
    port: int = 8765
    """Port of the server started for the benchmark."""
    num_threads: int | None = None
    """torch threads of the engine on both sides (default: torch's choice)."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        from deltaserve.utils.cli_args import check_at_least_one

        check_at_least_one(self, "num_requests", "input_len", "output_len")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")


def _summary(ttfts: list[float], total_s: float, n: int) -> dict[str, float]:
    ttfts = sorted(ttfts)
    return {"requests_per_s": n / total_s, "total_s": total_s, "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
            "ttft_median_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))]}


def run_engine(args: HttpBenchArgs, model: str, prompts: list[list[int]]) -> dict[str, float]:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine_core import EngineCore
    from deltaserve.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig(model=model, num_threads=args.num_threads))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):  # warm-up, no shared prefix with the timed prompts
        engine.add_request(f"w{i}", p[::-1], params)
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    return _summary(list(first.values()), time.perf_counter() - start, len(prompts))


async def _stream_one(client, url: str, prompt: list[int], args: HttpBenchArgs, start: float) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": args.output_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"the stream from {url}/v1/completions ended without a token")
    return ttft


async def _http_run(url: str, prompts: list[list[int]], args: HttpBenchArgs) -> dict[str, float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(_stream_one(client, url, p[::-1], args, time.perf_counter()) for p in prompts[:4]))
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(_stream_one(client, url, p, args, start) for p in prompts))
        return _summary(list(ttfts), time.perf_counter() - start, len(prompts))


def run_server(args: HttpBenchArgs, model: str, prompts: list[list[int]]) -> dict[str, float]:
    import httpx

    cmd = [sys.executable, "-m", "deltaserve.entrypoints.cli", "--log-level", "WARNING", "serve", "--model", model,
           "--port", str(args.port), "--served-model-name", "bench"]
    if args.num_threads is not None:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy in 300 s")
            time.sleep(0.2)
        return asyncio.run(_http_run(url, prompts, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(args: HttpBenchArgs) -> dict[str, object]:
    from deltaserve.bench.offline import random_prompts
    from deltaserve.config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from deltaserve.models.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny"))
        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = random_prompts(vocab, args.num_requests, args.input_len, args.seed)
        logger.info("engine direct: %d requests", len(prompts))
        engine = run_engine(args, model, prompts)
        logger.info("through HTTP: %d concurrent streaming requests", len(prompts))
        http = run_server(args, model, prompts)
    result = {"args": asdict(args), "engine": engine, "http": http,
              "requests_per_s_ratio": http["requests_per_s"] / engine["requests_per_s"],
              "ttft_mean_ratio": http["ttft_mean_ms"] / engine["ttft_mean_ms"]}
    print(f"{'':<14}{'req/s':>10}{'TTFT mean ms':>15}{'median':>10}{'p99':>10}")
    for name, r in (("engine", engine), ("HTTP server", http)):
        print(f"{name:<14}{r['requests_per_s']:>10.2f}{r['ttft_mean_ms']:>15.1f}{r['ttft_median_ms']:>10.1f}"
              f"{r['ttft_p99_ms']:>10.1f}")
    print(f"HTTP / engine: requests/s x{result['requests_per_s_ratio']:.3f}, "
          f"mean TTFT x{result['ttft_mean_ratio']:.3f}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("http", help="requests/s and TTFT through the HTTP server vs the engine directly")
    add_dataclass_args(p, HttpBenchArgs)
    p.set_defaults(func=lambda a: (run(dataclass_from_args(HttpBenchArgs, a)), 0)[1])
