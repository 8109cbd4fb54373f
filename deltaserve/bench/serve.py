"""`deltaserve bench serve`: a streaming load generator over the OpenAI API, measuring what `vllm bench serve` does.

Arrivals: all at once, or Poisson / gamma with burstiness, or trace timestamps; optionally capped by a client-side
concurrency semaphore. Prints vLLM's console table and writes vLLM's result JSON keys plus our additions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltaserve.bench.arrivals import arrival_delays
from deltaserve.bench.datasets import AGENTIC_TOOLS, AgenticSession, Dataset, SampleRequest, build_dataset
from deltaserve.bench.metrics import (
    RequestOutcome,
    format_table,
    parse_metric_names,
    parse_percentiles,
)
from deltaserve.bench.serve_config import ServeBenchConfig, add_config_args, config_from_args
from deltaserve.bench.serve_result import assemble_result, save_result, warn_unexpected_hits

if TYPE_CHECKING:
    import httpx

    from deltaserve.text.tokenizer import Tokenizer


class Progress:
    """A one-line progress indicator on stderr (a tqdm stand-in): redrawn in place on a terminal, else every 10%."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        step = max(1, self.total // 10)
        if self.tty or self.done % step == 0 or self.done == self.total:
            elapsed = time.perf_counter() - self.start
            bar = "#" * (20 * self.done // max(1, self.total))
            line = f"{self.done}/{self.total} [{bar:<20}] {elapsed:.1f} s, {self.done / max(elapsed, 1e-9):.2f} req/s"
            print(("\r" if self.tty else "") + line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr, flush=True)


def request_headers(cfg: ServeBenchConfig) -> dict[str, str]:
    """Headers of every request: the API key from OPENAI_API_KEY (vLLM's) or DELTASERVE_API_KEY, then --header
    KEY=VALUE pairs."""
    from deltaserve import envs

    key = envs.client_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for item in cfg.header or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: expected KEY=VALUE")
        headers[key.strip()] = value.strip()
    return headers


def load_tokenizer(cfg: ServeBenchConfig, served: dict[str, Any]) -> tuple[Tokenizer, str]:
    """(tokenizer, the directory it came from): --tokenizer, else --model when it is a checkpoint directory, else
    the served model's directory (`root` in /v1/models, as vLLM reports it) when that exists on this machine."""
    from deltaserve.text.tokenizer import Tokenizer

    root = served.get("root")
    candidates = (cfg.tokenizer, cfg.model if cfg.model and Path(cfg.model).is_dir() else None,
                  root if isinstance(root, str) and root and Path(root).is_dir() else None)
    path = next((c for c in candidates if c), None)
    if path is None:
        where = f"its model directory {root!r} is not on this machine" if root else "it reports no model directory"
        raise ValueError(f"a tokenizer is needed to build prompts and the server cannot lend one ({where}): pass "
                         "--tokenizer DIR (a checkpoint directory), or --model DIR")
    return Tokenizer.from_pretrained(path), path


def resolve_model(cfg: ServeBenchConfig, models: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(name sent in requests, the server's /v1/models entry of it): --served-model-name, else --model if served,
    else the server's first model."""
    ids = [m.get("id") for m in models]
    if cfg.served_model_name:
        name = cfg.served_model_name
    elif cfg.model is not None and cfg.model in ids:
        name = cfg.model
    elif isinstance(ids[0], str):
        name = ids[0]
    else:
        raise ValueError(f"the server's first model has no id: {models[0]!r:.200}")
    return name, next((m for m in models if m.get("id") == name), models[0])


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")


def _sampling(cfg: ServeBenchConfig) -> dict[str, Any]:
    body = {k: getattr(cfg, k) for k in SAMPLING_FIELDS if getattr(cfg, k) is not None}
    body["ignore_eos"] = cfg.sends_ignore_eos
    return body | (cfg.extra_body or {})


def completion_body(cfg: ServeBenchConfig, model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    logprobs = {"logprobs": cfg.logprobs} if cfg.logprobs is not None else {}
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, **logprobs, **_sampling(cfg)}


def chat_body(cfg: ServeBenchConfig, model: str, messages: list[dict[str, Any]], output_len: int,
              tools: bool = True) -> dict[str, Any]:
    """A streamed chat request: agentic turns offer the session's tools; decoded token prompts offer none."""
    extra: dict[str, Any] = {"tools": AGENTIC_TOOLS} if tools else {}
    if cfg.logprobs is not None:
        extra |= {"logprobs": True, "top_logprobs": cfg.logprobs}
    return {"model": model, "messages": messages, "max_completion_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, **extra, **_sampling(cfg)}


class Runner:
    """Sends one dataset to one server and collects the outcomes (in dataset order; sessions turn by turn)."""

    def __init__(self, cfg: ServeBenchConfig, client: httpx.AsyncClient, model: str, headers: dict[str, str],
                 tokenizer: Tokenizer) -> None:
        from deltaserve.bench import endpoint  # httpx: imported only when a benchmark runs

        self.endpoint = endpoint
        self.cfg, self.client, self.model, self.headers, self.tokenizer = cfg, client, model, headers, tokenizer
        self.url = cfg.url + cfg.endpoint_path

    async def completion(self, req: SampleRequest, prompt: list[int] | None = None,
                         output_len: int | None = None) -> RequestOutcome:
        """One token-id prompt: as is to completions, or decoded into one user message for --backend openai-chat
        (as vLLM sends its text prompts; the server's usage gives the prompt length after the chat template)."""
        ids = req.prompt if prompt is None else prompt
        output_len = req.output_len if output_len is None else output_len
        if self.cfg.backend_name == "openai-chat":
            message = {"role": "user", "content": self.tokenizer.decode(ids)}
            body = chat_body(self.cfg, self.model, [message], output_len, tools=False)
            return await self.endpoint.send_chat(self.client, self.url, body, self.headers, req.prompt_len)
        body = completion_body(self.cfg, self.model, ids, output_len)
        return await self.endpoint.send_completion(self.client, self.url, body, self.headers, req.prompt_len)

    async def session(self, index: int, s: AgenticSession, due: float, progress: Progress) -> list[RequestOutcome]:
        """The turns of one session, in order; turn k + 1 carries turn k's reply, a tool call and its result."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": s.system}, {"role": "user", "content": s.user}]
        outs: list[RequestOutcome] = []
        for turn in range(s.num_turns):
            body = chat_body(self.cfg, self.model, messages, s.output_len)
            out = await self.endpoint.send_chat(self.client, self.url, body, self.headers, prompt_len=0)
            out.queue_time = out.start_time - due if turn == 0 else 0.0
            outs.append(out)
            progress.update()
            if not out.success:
                break
            if turn + 1 < s.num_turns:
                call_id = f"call_{index}_{turn}"
                messages += [{"role": "assistant", "content": out.generated_text, "tool_calls": [
                                 {"id": call_id, "type": "function", "function": {
                                     "name": "run_command", "arguments": json.dumps({"command": f"step {turn}"})}}]},
                             {"role": "tool", "tool_call_id": call_id, "content": s.tool_results[turn]}]
                if self.cfg.agentic_tool_latency > 0:
                    await asyncio.sleep(self.cfg.agentic_tool_latency)
        return outs + [RequestOutcome(error="an earlier turn of the session failed")
                       for _ in range(s.num_turns - len(outs))]

    async def run(self, data: Dataset, delays: list[float]) -> tuple[list[RequestOutcome], float]:
        """Dispatch every request (or session) at its delay; returns the outcomes and the run's duration."""
        sem = asyncio.Semaphore(self.cfg.max_concurrency) if self.cfg.max_concurrency else contextlib.nullcontext()
        progress = Progress(data.num_requests, enabled=not self.cfg.disable_tqdm)
        start = time.perf_counter()

        async def one(req: SampleRequest, due: float) -> list[RequestOutcome]:
            async with sem:
                out = await self.completion(req)
            out.queue_time = out.start_time - due
            progress.update()
            return [out]

        async def one_session(i: int, s: AgenticSession, due: float) -> list[RequestOutcome]:
            async with sem:
                return await self.session(i, s, due, progress)

        items: Sequence[SampleRequest | AgenticSession] = data.requests or data.sessions
        tasks = []
        for i, (item, delay) in enumerate(zip(items, delays, strict=True)):
            due = start + delay
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            coro = one(item, due) if isinstance(item, SampleRequest) else one_session(i, item, due)
            tasks.append(asyncio.create_task(coro))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        return [o for r in results for o in r], duration

    async def check(self, data: Dataset) -> None:
        """vLLM's initial test request, then --num-warmups warm-ups: the first prompt reversed (so that no timed
        prompt shares its prefix), or a short chat turn."""
        for i in range(1 + self.cfg.num_warmups):
            test = i == 0  # the test request is short; warm-ups have the benchmark's output length
            if data.requests:
                first = data.requests[0]
                reverse = first.prompt[::-1]
                out = await self.completion(first, reverse[:32] if test else reverse, 2 if test else None)
            else:
                body = chat_body(self.cfg, self.model, [{"role": "user", "content": "Hello"}],
                                 2 if test else data.sessions[0].output_len)
                out = await self.endpoint.send_chat(self.client, self.url, body, self.headers, prompt_len=0)
            if not out.success:
                raise ValueError(f"the initial test request to {self.url} failed: {out.error}")


def send_delays(cfg: ServeBenchConfig, data: Dataset, seed: int) -> list[float]:
    items = data.requests or data.sessions
    if cfg.uses_timestamps:
        arrivals = [r.arrival_s for r in data.requests if r.arrival_s is not None]
        if not data.requests or len(arrivals) != len(data.requests):
            raise ValueError(f"--self-timed needs a dataset with timestamps (mooncake), not {cfg.dataset_name}")
        return arrivals
    return arrival_delays(len(items), cfg.request_rate, cfg.burstiness, seed, cfg.ramp_up)


async def run_async(cfg: ServeBenchConfig) -> dict[str, Any]:
    """One benchmark run against a live server; returns the result dict (also printed and, if asked, saved)."""
    import httpx

    from deltaserve.bench import endpoint, spec_metrics

    headers = request_headers(cfg)
    limit = cfg.max_concurrency or 1000
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600, connect=30), limits=limits,
                                 verify=not cfg.insecure) as client:
        models = await endpoint.wait_ready(client, cfg.url, headers, cfg.ready_check_timeout_sec)
        model, served = resolve_model(cfg, models)
        tokenizer, tokenizer_id = load_tokenizer(cfg, served)
        data = build_dataset(cfg, tokenizer, max_model_len=int(served.get("max_model_len") or 1 << 20),
                             seed=cfg.seed, model_dir=tokenizer_id)
        delays = send_delays(cfg, data, cfg.seed)
        runner = Runner(cfg, client, model, headers, tokenizer)
        flushed = await endpoint.reset_prefix_cache(client, cfg.url, headers) if cfg.reset_prefix_cache else None
        if flushed is False:
            print(f"warning: {cfg.url} has no POST /reset_prefix_cache; the prefix cache was not flushed",
                  file=sys.stderr)
        if cfg.ready_check_timeout_sec > 0:
            await runner.check(data)
        print(traffic_lines(cfg), flush=True)
        before = await endpoint.scrape_counters(client, cfg.url, headers)
        pos_before = await spec_metrics.scrape_accepted_per_pos(client, cfg.url, headers)
        outcomes, duration = await runner.run(data, delays)
        after = await endpoint.scrape_counters(client, cfg.url, headers)
        pos_after = await spec_metrics.scrape_accepted_per_pos(client, cfg.url, headers)
    result = assemble_result(cfg, model, data, outcomes, duration,
                             count_tokens=lambda text: len(tokenizer.encode(text, allow_special=False)),
                             tokenizer_id=tokenizer_id)
    result |= endpoint.counter_metrics(before, after)
    if result.get("spec_decode_num_drafts"):
        result["spec_decode_per_position_acceptance_rates"] = spec_metrics.per_position_rates(
            pos_before, pos_after, result["spec_decode_num_drafts"])
    result["prefix_cache_flushed"] = flushed
    warn_unexpected_hits(cfg, result)
    print(format_table(result, selected=parse_metric_names(cfg.percentile_metrics or "ttft,tpot,itl"),
                       percentiles=parse_percentiles(cfg.metric_percentiles)))
    if spec_section := spec_metrics.spec_decode_section(result):
        print(spec_section)
    if cfg.save_result or cfg.append_result:
        save_result(cfg, result)
    return result


def traffic_lines(cfg: ServeBenchConfig) -> str:
    """vLLM's lines before the run: the rate (or the ramp-up), the burstiness and its distribution, concurrency."""
    if cfg.ramp_up_strategy is not None:
        rate = (f"Traffic ramp-up strategy: {cfg.ramp_up_strategy}. Will increase RPS from {cfg.ramp_up_start_rps} "
                f"to {cfg.ramp_up_end_rps} RPS over the duration of the benchmark.")
    else:
        rate = f"Traffic request rate: {cfg.request_rate}{' (trace timestamps)' if cfg.uses_timestamps else ''}"
    distribution = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
    return (f"{rate}\nBurstiness factor: {cfg.burstiness} ({distribution})\n"
            f"Maximum request concurrency: {cfg.max_concurrency}")


def run(cfg: ServeBenchConfig) -> dict[str, Any]:
    return asyncio.run(run_async(cfg))


def quiet_http_logs() -> None:
    """httpx logs every request at INFO; the CLI's default level would print one line per benchmark request."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def _main(ns: argparse.Namespace) -> int:
    quiet_http_logs()
    result = run(config_from_args(ServeBenchConfig, ns))
    return 0 if result["completed"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `serve` under `deltaserve bench`."""
    p = sub.add_parser("serve", help="load generator over the OpenAI API (vllm bench serve's metrics and flags)",
                       description=__doc__.splitlines()[0])
    add_config_args(p, ServeBenchConfig)
    p.set_defaults(func=_main)
