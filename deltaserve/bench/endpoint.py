"""The benchmark client's HTTP side: one streamed request -> `RequestOutcome`, plus readiness, /metrics and flush.

Timing follows `vllm bench serve` (`endpoint_request_func.py`): start just before the POST; TTFT at the first SSE
message with a non-empty `choices` list; ITL between consecutive `choices` messages; E2EL at the last one (the
usage-only message is excluded); output tokens from `usage.completion_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from deltaserve.bench.metrics import RequestOutcome

NO_FIRST_CHUNK = "Never received a valid chunk to calculate TTFT."


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], *,
                         prompt_len: int, on_choice: Callable[[dict[str, Any]], None] | None = None) -> RequestOutcome:
    """POST `body` (which must ask for streaming with usage) and time its SSE messages.

    `on_choice` sees the first choice of every `choices` message (to collect text, deltas, tool calls).
    A non-200 status, an `error` event, a broken connection or no `choices` message marks the outcome failed.
    """
    out = RequestOutcome(prompt_len=prompt_len)
    start = last = time.perf_counter()
    out.start_time = start
    first = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:500]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data and not data.get("choices"):
                    out.error = f"error event: {json.dumps(data['error'])[:500]}"
                    return out
                if choices := data.get("choices"):
                    if first:
                        out.itl.append(now - last)
                    else:
                        out.ttft, first = now - start, True
                    last = now
                    if on_choice is not None:
                        on_choice(choices[0])
                if usage := data.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or 0
                    out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.success = first
    out.error = "" if first else NO_FIRST_CHUNK
    out.latency = last - start
    return out


async def send_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                          headers: dict[str, str], prompt_len: int) -> RequestOutcome:
    """A /v1/completions request; the generated text is kept for token re-counting."""
    parts: list[str] = []
    out = await stream_request(client, url, body, headers, prompt_len=prompt_len,
                               on_choice=lambda c: parts.append(c.get("text") or ""))
    out.generated_text = "".join(parts)
    return out


async def send_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                    prompt_len: int) -> RequestOutcome:
    """A /v1/chat/completions request; the reply's content (reasoning excluded) becomes `generated_text`."""
    parts: list[str] = []

    def collect(choice: dict[str, Any]) -> None:
        parts.append((choice.get("delta") or {}).get("content") or "")

    out = await stream_request(client, url, body, headers, prompt_len=prompt_len, on_choice=collect)
    out.generated_text = "".join(parts)
    return out


async def wait_ready(client: httpx.AsyncClient, base_url: str, headers: dict[str, str],
                     timeout_s: float) -> list[dict[str, Any]]:
    """The server's model list (GET /v1/models), retried until `timeout_s`; ValueError naming the URL if not."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await client.get(f"{base_url}/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); "
                                 f"is it running? (waited {timeout_s:g} s, see --ready-check-timeout-sec)") from exc
            await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
            continue
        if resp.status_code != 200:
            raise ValueError(f"GET {base_url}/v1/models returned HTTP {resp.status_code}: {resp.text[:300]}")
        models = resp.json().get("data") or []
        if not models:
            raise ValueError(f"the server at {base_url} lists no models")
        return models


async def reset_prefix_cache(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> bool:
    """POST /reset_prefix_cache (vLLM's endpoint); False when the server has none."""
    try:
        resp = await client.post(f"{base_url}/reset_prefix_cache", headers=headers, timeout=60)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
COUNTERS = {"prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
            "spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
            "spec_decode_num_accepted_tokens": "accepted_tokens"}
"""Counter name (any `vllm:` / `deltaserve:` prefix, `_total` suffix dropped) -> our short name."""


async def scrape_counters(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """Sums of the counters above from GET /metrics (empty when the server has no /metrics)."""
    try:
        resp = await client.get(f"{base_url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    return parse_counters(resp.text)


def parse_counters(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m.group(1).rsplit(":", 1)[-1].removesuffix("_total")
        if name in COUNTERS:
            totals[COUNTERS[name]] = totals.get(COUNTERS[name], 0.0) + float(m.group(3))
    return totals


def counter_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Server-side results of the run: vLLM's `spec_decode_*` keys and our server prefix-cache hit rate."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict[str, Any] = {}
    if delta.get("prefix_cache_queries"):
        out["server_prefix_cache_hit_rate"] = delta.get("prefix_cache_hits", 0.0) / delta["prefix_cache_queries"]
    if delta.get("drafts"):
        accepted, draft_tokens = delta.get("accepted_tokens", 0.0), delta.get("draft_tokens", 0.0)
        out |= {"spec_decode_acceptance_rate": accepted / draft_tokens * 100 if draft_tokens else None,
                "spec_decode_acceptance_length": 1 + accepted / delta["drafts"],
                "spec_decode_num_drafts": int(delta["drafts"]), "spec_decode_draft_tokens": int(draft_tokens),
                "spec_decode_accepted_tokens": int(accepted)}
    return out
