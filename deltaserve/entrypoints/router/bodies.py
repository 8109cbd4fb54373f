"""The router's routes and the request bodies it sends: the prefill request (one token, not streamed, asking for a
transfer) and the decode request (the client's, plus the prefill's `kv_transfer_params`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_TRANSFER_PARAMS = "kv_transfer_params"

# Fields a one-token, non-streamed prefill request must not carry: several choices, stream options, logprobs,
# echo, and limits a one-token request would fail (min_tokens above 1, max_completion_tokens besides max_tokens).
_OPENAI_PREFILL_DROPS = ("max_completion_tokens", "n", "best_of", "stream_options", "logprobs", "top_logprobs",
                         "echo", "min_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One proxied route."""

    path: str
    api: str
    """'openai' or 'anthropic': the shape of the router's own error bodies and stream error events."""
    disaggregated: bool
    """True: prefill instance, then decode instance; False: a decode instance alone."""


ROUTES: tuple[Route, ...] = (
    Route(path="/v1/chat/completions", api="openai", disaggregated=True),
    Route(path="/v1/completions", api="openai", disaggregated=True),
    Route(path="/v1/messages", api="anthropic", disaggregated=True),
    Route(path="/v1/messages/count_tokens", api="anthropic", disaggregated=False),
    Route(path="/tokenize", api="openai", disaggregated=False),
    Route(path="/detokenize", api="openai", disaggregated=False),
)


def can_prefill_remotely(route: Route, body: Any) -> bool:
    """Whether the request is one a prefill instance can compute alone: a JSON object on a generation route with
    one prompt (a list of prompts to /v1/completions has no single cache to hand over: its decode instance
    prefills them)."""
    if not route.disaggregated or not isinstance(body, dict):
        return False
    prompt = body.get("prompt")
    return not (route.path == "/v1/completions" and isinstance(prompt, list) and prompt
                and isinstance(prompt[0], str | list))


def prefill_body(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a prefill request: one token, not streamed, `kv_transfer_params.do_remote_decode`."""
    out = dict(body)
    if route.api == "openai":
        for name in _OPENAI_PREFILL_DROPS:
            out.pop(name, None)
    out.update({"max_tokens": 1, "stream": False, KV_TRANSFER_PARAMS: {"do_remote_decode": True}})
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body with the prefill's `kv_transfer_params` (a client's own are dropped: the router decides)."""
    out = {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS}
    if kv_transfer_params is not None:
        out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


def wants_stream(body: Any) -> bool:
    return isinstance(body, dict) and body.get("stream") is True
