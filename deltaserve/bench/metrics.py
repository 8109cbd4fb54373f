"""Serving-benchmark metric math, with `vllm bench serve`'s definitions and JSON key names.

Works on per-request client timestamps only (no HTTP here), so it is unit-testable on synthetic timings. The
definitions are those of `metrics-and-roofline.md` §1 (vLLM's `calculate_metrics`); additions are named below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
"""Latency metrics with mean / median / std / percentile statistics, in vLLM's order."""
QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")
"""vLLM's client-side queueing metrics (only with --max-concurrency, only when named in --percentile-metrics)."""
ALWAYS_PERCENTILES = (90.0, 99.0)
"""Percentiles written to the JSON for every metric, besides the requested ones."""
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestOutcome:
    """What the client observed for one request. Times are seconds of `time.perf_counter()`."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    """Prompt tokens: the server's `usage.prompt_tokens` when reported, else the dataset's length."""
    output_tokens: int = 0
    """`usage.completion_tokens` of the final chunk; 0 when the server reported none."""
    ttft: float = 0.0
    """First chunk with a non-empty `choices` list - start."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive `choices` chunks (per chunk, not per token)."""
    latency: float = 0.0
    """E2EL: last `choices` chunk - start (the usage-only chunk excluded)."""
    start_time: float = 0.0
    """Just before the POST."""
    queue_time: float = 0.0
    """start_time - the time the request was due by the arrival schedule (waiting for a --max-concurrency seat)."""
    generated_text: str = ""
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens` (prefix-cache hit), None when not reported."""


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError on bad input."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or number is None:
            raise ValueError(f"--goodput {pair!r}: expected KEY:VALUE with a number of milliseconds, e.g. ttft:500")
        if name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {pair!r}: the SLO name must be one of {', '.join(GOODPUT_KEYS)}")
        if number < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO value must be non-negative")
        slos[name] = number
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"50,99"` -> [50.0, 99.0]; each must lie in [0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ValueError(f"--metric-percentiles {text!r}: expected comma-separated numbers") from exc
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: each percentile must be between 0 and 100")
    return values


def parse_metric_names(text: str) -> list[str]:
    """`"ttft,tpot"` -> ["ttft", "tpot"], checked against the known metric names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS + QUEUE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: allowed names are {', '.join(METRICS + QUEUE_METRICS)}")
    return names


def percentile_word(p: float) -> str:
    """vLLM's key spelling of a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(prefix: str, values_s: Sequence[float], percentiles: Sequence[float], scale: float = 1000.0,
           unit: str = "_ms") -> dict[str, float]:
    """vLLM's statistics of one metric: mean, median, std (population), percentiles (linear interpolation).

    An empty list counts as [0], as in vLLM (`np.mean(x or 0)`).
    """
    data = list(values_s) or [0.0]
    out = {f"mean_{prefix}{unit}": float(np.mean(data)) * scale,
           f"median_{prefix}{unit}": float(np.median(data)) * scale,
           f"std_{prefix}{unit}": float(np.std(data)) * scale}
    for p in percentiles:
        out[f"p{percentile_word(p)}_{prefix}{unit}"] = float(np.percentile(data, p)) * scale
    return out


def peak_output_tokens_per_s(outcomes: Sequence[RequestOutcome]) -> float:
    """vLLM's `max_output_tokens_per_s`: the fullest 1-second bucket of chunk arrivals (first chunk + ITLs).

    Buckets start at the earliest successful start; each chunk counts as one token, as in vLLM.
    """
    ok = [o for o in outcomes if o.success]
    if not ok:
        return 0.0
    t0 = min(o.start_time for o in ok)
    end = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(end - t0)) + 1)
    for o in ok:
        times = o.start_time + o.ttft + np.concatenate(([0.0], np.cumsum(o.itl)))
        idx = (times - t0).astype(int)
        np.add.at(buckets, idx[(idx >= 0) & (idx < len(buckets))], 1)
    return float(buckets.max())


def max_concurrent_requests(outcomes: Sequence[RequestOutcome]) -> int:
    """Most successful requests in flight at once: an exact sweep over [start, start + E2EL) intervals."""
    events = sorted([(o.start_time, 1) for o in outcomes if o.success]
                    + [(o.start_time + o.latency, -1) for o in outcomes if o.success])  # ends sort before starts
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def user_decode_speeds(outcomes: Sequence[RequestOutcome], output_lens: Sequence[int]) -> list[float]:
    """Per-user decode speed (tokens/s) of each successful request with > 1 output token: 1 / TPOT."""
    return [(n - 1) / (o.latency - o.ttft) for o, n in zip(outcomes, output_lens, strict=True)
            if o.success and n > 1 and o.latency > o.ttft]


def compute_metrics(outcomes: Sequence[RequestOutcome], duration_s: float, *, percentiles: Sequence[float] = (99.0,),
                    goodput: dict[str, float] | None = None, queue_metrics: Sequence[str] = (),
                    count_tokens: Callable[[str], int] | None = None) -> tuple[dict[str, Any], list[int]]:
    """Every aggregate of a run, keyed as in vLLM's result JSON, plus our additions; and the output lengths.

    Args:
        outcomes: one per request, failed ones included (they count in `failed` only).
        duration_s: wall time of the run (first dispatch to last completion).
        percentiles: the requested percentiles; p90 and p99 are always added.
        goodput: SLOs in ms by name (`ttft`, `tpot`, `e2el`); empty or None: `request_goodput` is None.
        queue_metrics: which of `client_queue_time` / `e2el_including_client_queue` to report (the caller
            applies vLLM's conditions: --max-concurrency set, and a finite rate for the second).
        count_tokens: re-tokenises the generated text when the server reported no `completion_tokens`.
    """
    output_lens: list[int] = []
    ttfts, tpots, all_tpots, itls, e2els, queues = [], [], [], [], [], []
    total_input = completed = 0
    for o in outcomes:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or (count_tokens(o.generated_text) if count_tokens else 0)
        output_lens.append(n)
        total_input += o.prompt_len
        completed += 1
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)  # 0 for <= 1 output token: such a request meets any TPOT SLO
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        queues.append(o.queue_time)
    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        columns = [(per_metric[k], v / 1000) for k, v in goodput.items()]
        good = sum(all(values[i] <= slo for values, slo in columns) for i in range(completed))
    total_output = sum(output_lens)
    pcts = sorted(set(percentiles) | set(ALWAYS_PERCENTILES))
    result: dict[str, Any] = {
        "duration": duration_s, "completed": completed, "failed": len(outcomes) - completed,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_output_tokens_per_s(outcomes),
        "max_concurrent_requests": max_concurrent_requests(outcomes),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result |= _stats(name, values, pcts)
    if "client_queue_time" in queue_metrics:
        result |= _stats("client_queue_time", queues, pcts)
    if "e2el_including_client_queue" in queue_metrics:
        result |= _stats("e2el_including_client_queue", [e + q for e, q in zip(e2els, queues, strict=True)], pcts)
    result |= _stats("per_user_decode", user_decode_speeds(outcomes, output_lens), (10.0, 50.0), 1.0, "_tok_s")
    cached = [o.cached_tokens for o in outcomes if o.success and o.cached_tokens is not None]
    result["total_cached_tokens"] = sum(cached) if cached else None
    result["prefix_cache_hit_rate"] = sum(cached) / max(1, total_input) if cached else None
    return result, output_lens


def format_table(result: dict[str, Any], *, selected: Sequence[str], percentiles: Sequence[float]) -> str:
    """The console summary in vLLM's layout, with a per-user decode speed section added."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate", "inf") != "inf":
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    if result.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (client):", f"{result['prefix_cache_hit_rate']:.1%}")
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
               "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
               "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency")}
    for name in selected:
        if f"mean_{name}_ms" not in result:
            continue
        short, header = headers[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{name}_ms"], ".2f")
    lines.append("{s:{c}^{n}}".format(s="Per-user Decode Speed (1 / TPOT)", n=50, c="-"))
    row("Mean per-user decode (tok/s):", result["mean_per_user_decode_tok_s"], ".2f")
    row("Median per-user decode (tok/s):", result["median_per_user_decode_tok_s"], ".2f")
    row("P10 per-user decode (tok/s):", result["p10_per_user_decode_tok_s"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
