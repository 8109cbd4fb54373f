"""`bench serve` metric math on synthetic timestamps: vLLM's definitions of TTFT, ITL, TPOT, E2EL, goodput, peaks."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from deltaserve.bench import endpoint
from deltaserve.bench.arrivals import arrival_delays, request_rates
from deltaserve.bench.metrics import (
    RequestOutcome,
    compute_metrics,
    format_table,
    max_concurrent_requests,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    peak_output_tokens_per_s,
)


def _ok(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10, queue: float = 0.0):
    return RequestOutcome(success=True, prompt_len=prompt, output_tokens=tokens, ttft=ttft, itl=itl,
                          latency=ttft + sum(itl), start_time=start, queue_time=queue)


# Three requests with known timings (seconds): TTFTs 0.1 / 0.2 / 0.4, E2ELs 0.4 / 0.6 / 0.4, TPOTs 0.1 / 0.2 / -.
A = _ok(0.0, 0.1, [0.1, 0.1, 0.1], 4)
B = _ok(0.5, 0.2, [0.4], 3)          # one chunk carried two tokens: 1 gap, TPOT = 0.4 / 2 = 0.2
C = _ok(1.0, 0.4, [], 1)             # a single token: no TPOT, counts as TPOT 0 for goodput
FAILED = RequestOutcome(error="boom", prompt_len=99)


def test_per_request_and_aggregate_definitions():
    """TTFT/E2EL over successes, TPOT only with > 1 token, ITL pooled over every gap, failures excluded."""
    res, lens = compute_metrics([A, B, C, FAILED], duration_s=2.0, percentiles=[50])
    assert lens == [4, 3, 1, 0]
    assert (res["completed"], res["failed"]) == (3, 1)
    assert res["total_input_tokens"] == 30 and res["total_output_tokens"] == 8
    assert res["request_throughput"] == pytest.approx(1.5)
    assert res["output_throughput"] == pytest.approx(4.0)
    assert res["total_token_throughput"] == pytest.approx(19.0)
    assert res["request_goodput"] is None
    assert res["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert res["median_ttft_ms"] == pytest.approx(200)
    assert res["std_ttft_ms"] == pytest.approx(np.std([100, 200, 400]))
    assert res["mean_tpot_ms"] == pytest.approx(150) and res["median_tpot_ms"] == pytest.approx(150)
    assert res["mean_itl_ms"] == pytest.approx(175)  # (100 + 100 + 100 + 400) / 4 gaps
    assert res["median_e2el_ms"] == pytest.approx(400) and res["mean_e2el_ms"] == pytest.approx(1400 / 3)
    # per-user decode speed = 1 / TPOT, over requests with > 1 token: 10 and 5 tok/s
    assert res["mean_per_user_decode_tok_s"] == pytest.approx(7.5)
    assert res["p10_per_user_decode_tok_s"] == pytest.approx(5.5)  # linear interpolation between 5 and 10


def test_percentiles_are_numpy_linear_and_always_include_p90_p99():
    """pP keys use vLLM's spelling and numpy's linear interpolation; p90 and p99 are always present."""
    outs = [_ok(i, t, [0.01], 2) for i, t in enumerate([0.1, 0.2, 0.3, 0.4, 1.0])]
    res, _ = compute_metrics(outs, 10.0, percentiles=[25, 99.9])
    ttfts = [100, 200, 300, 400, 1000]
    for p, key in ((25, "p25"), (90, "p90"), (99, "p99"), (99.9, "p99.9")):
        assert res[f"{key}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p))
        assert f"{key}_itl_ms" in res and f"{key}_tpot_ms" in res and f"{key}_e2el_ms" in res
    assert res["p90_ttft_ms"] == pytest.approx(760.0)


def test_goodput_counts_requests_meeting_every_slo():
    """DistServe goodput: a success meets every given SLO (<=); TPOT of a 1-token request is 0."""
    res, _ = compute_metrics([A, B, C, FAILED], 2.0, goodput={"ttft": 300})
    assert res["request_goodput"] == pytest.approx(2 / 2.0)  # A, B; C's TTFT is 400
    res, _ = compute_metrics([A, B, C], 2.0, goodput={"tpot": 150})
    assert res["request_goodput"] == pytest.approx(2 / 2.0)  # A (100 ms) and C (TPOT 0); B's is 200 ms
    res, _ = compute_metrics([A, B, C], 2.0, goodput={"ttft": 300, "e2el": 450})
    assert res["request_goodput"] == pytest.approx(1 / 2.0)  # only A


def test_output_tokens_fall_back_to_re_tokenising():
    """Without usage.completion_tokens the generated text is re-tokenised (vLLM's fallback)."""
    out = _ok(0.0, 0.1, [0.1], 0)
    out.generated_text = "a b c"
    res, lens = compute_metrics([out], 1.0, count_tokens=lambda t: len(t.split()))
    assert lens == [3] and res["mean_tpot_ms"] == pytest.approx(50)


def test_peak_tokens_and_max_concurrency():
    """Peak 1-second bucket of chunk arrivals; exact sweep line over request intervals (touching ends do not
    overlap)."""
    burst = _ok(0.0, 0.125, [0.125] * 9, 10)        # chunks at 0.125, 0.25, ..., 1.25 s: 7 in second 0, 3 in 1
    late = _ok(1.25, 0.125, [0.125] * 4, 5)         # chunks at 1.375 .. 1.875 s: 5 more in second 1
    assert peak_output_tokens_per_s([burst, late]) == 8.0
    assert max_concurrent_requests([burst, late]) == 1   # burst ends at 1.25 s exactly when late starts
    overlapping = [_ok(0.0, 0.1, [1.0], 2), _ok(0.5, 0.1, [1.0], 2), _ok(0.6, 0.1, [0.1], 2)]
    assert max_concurrent_requests(overlapping) == 3
    assert max_concurrent_requests([FAILED]) == 0 and peak_output_tokens_per_s([FAILED]) == 0.0


def test_client_queue_metrics_only_when_asked():
    """client_queue_time and e2el_including_client_queue appear only when requested."""
    outs = [_ok(0.0, 0.1, [0.1], 2, queue=0.0), _ok(0.2, 0.1, [0.1], 2, queue=0.2)]
    res, _ = compute_metrics(outs, 1.0)
    assert "mean_client_queue_time_ms" not in res
    res, _ = compute_metrics(outs, 1.0, queue_metrics=["client_queue_time", "e2el_including_client_queue"])
    assert res["mean_client_queue_time_ms"] == pytest.approx(100)
    assert res["mean_e2el_including_client_queue_ms"] == pytest.approx(300)


def test_empty_run_reports_zeros():
    """All requests failed: zeros as in vLLM (np.mean([0])), no crash."""
    res, _ = compute_metrics([FAILED], 1.0, goodput={"ttft": 1})
    assert res["completed"] == 0 and res["mean_ttft_ms"] == 0.0 and res["request_goodput"] == 0.0
    assert res["prefix_cache_hit_rate"] is None


def test_parsers_reject_bad_input():
    """Goodput, percentile and metric-name strings fail with messages naming the flag."""
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["ttft:x"], ["itl:5"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    for bad in ("", "x", "101"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_metric_names("ttft,latency")


def test_arrival_delays_follow_vllm():
    """inf -> all at 0; finite -> gamma gaps rescaled so the last departs at n / rate; burstiness inf -> uniform."""
    assert arrival_delays(4, float("inf"), 1.0, 0) == [0.0] * 4
    d = arrival_delays(50, 10.0, 1.0, 0)
    assert d[-1] == pytest.approx(5.0) and all(b >= a for a, b in zip(d, d[1:], strict=False))
    assert arrival_delays(4, 2.0, float("inf"), 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    bursty, smooth = np.diff(arrival_delays(2000, 10.0, 0.25, 1)), np.diff(arrival_delays(2000, 10.0, 4.0, 1))
    assert np.std(bursty) > 2 * np.std(smooth)  # gamma shape < 1 is burstier


def test_ramp_up_raises_the_rate_over_the_run():
    """vLLM's ramp-up: request i arrives at rate start + (end - start) * i / (n - 1) (linear) or
    start * (end / start) ** (i / (n - 1)) (exponential); with uniform gaps the delays are the cumulated 1 / rate,
    not rescaled."""
    assert request_rates(3, float("inf"), ("linear", 1.0, 5.0)).tolist() == [1.0, 3.0, 5.0]
    assert request_rates(3, float("inf"), ("exponential", 1.0, 16.0)).tolist() == [1.0, 4.0, 16.0]
    assert arrival_delays(3, float("inf"), float("inf"), 0, ("linear", 1.0, 5.0)) == pytest.approx(
        [1.0, 1.0 + 1 / 3, 1.0 + 1 / 3 + 1 / 5])
    gaps = np.diff(arrival_delays(4000, float("inf"), 1.0, 3, ("linear", 1.0, 50.0)))
    assert np.mean(gaps[:400]) > 5 * np.mean(gaps[-400:])  # gamma gaps with mean 1 / rate shrink as the rate grows


def test_console_table_has_vllm_lines():
    """The summary uses vLLM's row labels and prints only the selected metrics and percentiles."""
    res, _ = compute_metrics([A, B, C], 2.0, percentiles=[99], goodput={"ttft": 300})
    res |= {"max_concurrency": 4, "request_rate": "inf"}
    text = format_table(res, selected=["ttft", "itl"], percentiles=[99])
    for label in ("Successful requests:", "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "P99 ITL (ms):", "P10 per-user decode (tok/s):", "Maximum request concurrency:"):
        assert label in text
    assert "TPOT" not in text.replace("(1 / TPOT)", "") and "E2EL" not in text
    assert "Total token throughput (tok/s):" in text  # current vLLM's spelling (the old script had "Token")
    queue = format_table(res | {"mean_client_queue_time_ms": 1.0, "median_client_queue_time_ms": 1.0,
                                "p99_client_queue_time_ms": 2.0},
                         selected=["client_queue_time"], percentiles=[99])
    assert "Client-side Queueing" in queue and "P99 Client Queue Time (ms):" in queue


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _fetch(body: bytes, status: int = 200):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await endpoint.send_completion(client, "http://x/v1/completions", {}, {}, prompt_len=7)

    return asyncio.run(go())


def test_stream_parsing_counts_choice_chunks_only():
    """TTFT at the first choices chunk (even with empty text), ITL per later choices chunk, usage-only excluded."""
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}
    out = _fetch(b": ping\n\n" + _sse({"choices": [{"text": ""}]}, {"choices": [{"text": "ab"}]},
                                      {"choices": [{"text": "c"}]}, {"choices": [], "usage": usage}, "[DONE]"))
    assert out.success and out.error == ""
    assert len(out.itl) == 2 and out.generated_text == "abc"
    assert (out.output_tokens, out.prompt_len, out.cached_tokens) == (4, 5, 2)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))


def test_stream_failures_are_marked():
    """No choices chunk, an error event, or an HTTP error status each fail the request with a reason."""
    assert _fetch(_sse({"choices": [], "usage": {"completion_tokens": 0}}, "[DONE]")).error == endpoint.NO_FIRST_CHUNK
    out = _fetch(_sse({"error": {"message": "engine died"}}, "[DONE]"))
    assert not out.success and "engine died" in out.error
    out = _fetch(b'{"error": "nope"}', status=400)
    assert not out.success and out.error.startswith("HTTP 400")


def test_metrics_scrape_gives_server_hit_rate_and_spec_decode_keys():
    """Counters (any prefix, _total dropped, labels summed) become vLLM's spec_decode_* keys and a hit rate."""
    before = endpoint.parse_counters('deltaserve:prefix_cache_queries_total{model_name="m"} 100\n'
                                     'deltaserve:prefix_cache_hits_total{model_name="m"} 10\n')
    after = endpoint.parse_counters('# HELP x\ndeltaserve:prefix_cache_queries_total{model_name="m"} 300\n'
                                    'deltaserve:prefix_cache_hits_total{model_name="m"} 110\n'
                                    'vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_draft_tokens_total 40\n'
                                    'vllm:spec_decode_num_accepted_tokens_total{pos="0"} 15\n'
                                    'vllm:spec_decode_num_accepted_tokens_total{pos="1"} 5\n')
    res = endpoint.counter_metrics(before, after)
    assert res["server_prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert res["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert res["spec_decode_acceptance_length"] == pytest.approx(3.0)
    assert endpoint.counter_metrics({}, {}) == {}
