"""The router's own errors, in the route's API shape: a JSON response before anything was sent, an SSE event (and
the end of the stream) after a stream began."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from deltaserve.entrypoints.server.errors import ApiError


def error_response(api: str, status: int, message: str, code: str | None = None) -> JSONResponse:
    """OpenAI's `{"error": {...}}` or, for api='anthropic', `{"type": "error", "error": {...}}`."""
    err = ApiError(status, message, code=code)
    body = err.anthropic_body() if api == "anthropic" else err.openai_body()
    return JSONResponse(body, status_code=status)


def error_event(api: str, status: int, message: str, code: str | None = None) -> bytes:
    """What a stream already under way sends last: Anthropic's `event: error`, or OpenAI's error chunk and
    `data: [DONE]` (what deltaserve's own streams send on an error)."""
    err = ApiError(status, message, code=code)
    if api == "anthropic":
        return f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n".encode()
    return f"data: {json.dumps(err.openai_body())}\n\ndata: [DONE]\n\n".encode()
