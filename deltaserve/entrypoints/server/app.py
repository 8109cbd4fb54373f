"""The FastAPI app: routes, body limits, auth, error bodies; and `serve()`, which starts the engine and uvicorn.

Every POST route reads its body itself (size limit, malformed JSON, pydantic validation) so each failure has the
right status and the right error shape: OpenAI's on /v1/completions and /v1/chat/completions, Anthropic's on
/v1/messages. A non-streaming request is cancelled (and its sequences aborted) when the client disconnects;
a streaming one when the event stream is closed. Both are also ended at their deadline (`--request-timeout-s`)
and by a drain that ran out of time (server/lifecycle.py); `AdmissionGate` refuses new requests while draining.

/health asks the engine: 200 while the engine process runs and its heartbeat is recent (`--health-timeout-s`),
503 otherwise (dead, exited, or stopped/frozen); with data parallelism, while any replica does.

The `X-Session-ID` header, when sent, is the request's session id for the data-parallel router (it takes the place
of OpenAI's `user` / Anthropic's `metadata.user_id`, which are the session id otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.engine.client import AsyncEngineClient
from deltaserve.engine.dp_client import DPEngineClient
from deltaserve.entrypoints.anthropic.messages import count_tokens, create_message, create_message_stream
from deltaserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from deltaserve.entrypoints.openai.chat import chat_completion, chat_completion_stream
from deltaserve.entrypoints.openai.completions import completion, completion_stream
from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
)
from deltaserve.entrypoints.openai.tokenize import TOKENIZE_REQUEST, detokenize, tokenize
from deltaserve.entrypoints.server.errors import ApiError, ErrorEvent, validation_message
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.entrypoints.server.json_body import parse_json_object
from deltaserve.entrypoints.server.lifecycle import AdmissionGate, Lifecycle
from deltaserve.entrypoints.server.metrics import ReplicaCollector, ServerMetrics
from deltaserve.entrypoints.server.status import status_router

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
SESSION_HEADER = "x-session-id"
"""Request header naming the client's session (data-parallel routing keeps a session on one replica)."""
PARSE_OFF_LOOP_BYTES = 1 << 20
"""Bodies of at least this many bytes are parsed and validated in the frontend's render threads: an 8 MB body takes
~10 ms of decoding, scanning and `json.loads` (15-20 ms in a loaded server), and validating 120,000 small messages
~0.7-1.2 s, which on the loop is one stall; in a thread the loop runs between those steps."""


def _is_anthropic(request: Request) -> bool:
    return _is_anthropic_path(request.url.path)


def _is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    return _error_for_path(request.url.path, err)


def _error_for_path(path: str, err: ApiError) -> JSONResponse:
    body = err.anthropic_body() if _is_anthropic_path(path) else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _error_event(path: str) -> Callable[[ApiError], str]:
    """How a stream on `path` reports an error after its headers went out (what the route's own stream sends)."""
    if _is_anthropic_path(path):
        return ApiError.anthropic_event
    return lambda err: ErrorEvent(err.openai_event() + "data: [DONE]\n\n", err.status)


async def _counting_errors(events: AsyncIterator[str], metrics: ServerMetrics) -> AsyncIterator[str]:
    """`events`, with the stream's failure counted in the request errors once (its 200 is counted already): the
    status of its first `ErrorEvent`; else 499 when it is closed before its end (the client went away), as for a
    non-streamed request whose client leaves, or 500 when it raises."""
    failed = False
    try:
        async for event in events:
            if isinstance(event, ErrorEvent) and not failed:
                failed = True
                metrics.observe_error(event.status)
            yield event
    except (GeneratorExit, asyncio.CancelledError):
        if not failed:
            metrics.observe_error(499)
        raise
    except Exception:
        logger.exception("unhandled error in a stream")
        if not failed:
            metrics.observe_error(500)
        raise


async def _read_body(request: Request, frontend: Frontend, model: type[BaseModel] | TypeAdapter) -> Any:
    """The request body parsed and validated as `model`; a body of a megabyte or more off the event loop (parsing
    and validating 8 MB of small messages took ~1 s)."""
    limit, timeout_s = frontend.config.max_request_bytes, frontend.config.body_timeout_s
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):  # a client that never finishes its body is not waited for forever
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    raw = b"".join(chunks)
    if len(raw) >= PARSE_OFF_LOOP_BYTES:
        return await frontend.offload(_parse, raw, model)
    return _parse(raw, model)


def _parse(raw: bytes, model: type[BaseModel] | TypeAdapter) -> Any:
    data = parse_json_object(raw)
    try:
        return model.validate_python(data) if isinstance(model, TypeAdapter) else model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(422 if _is_type_error(exc) else 400, message, param=param) from exc


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _authorize(frontend: Frontend, request: Request) -> None:
    api_key = frontend.config.api_key
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        how = "'x-api-key: KEY' or 'Authorization: Bearer KEY'" if _is_anthropic(request) else \
            "'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        raise ApiError(401, f"invalid or missing API key: this server was started with --api-key (or "
                            f"$DELTASERVE_API_KEY), which guards /v1/*, /tokenize, /detokenize and "
                            f"/reset_prefix_cache; send {how}", code="invalid_api_key")


async def _handle(frontend: Frontend, lifecycle: Lifecycle, request: Request, route: str,
                  model: type[BaseModel] | TypeAdapter, run: Callable[[Frontend, Any], Awaitable[dict[str, Any]]],
                  run_stream: Callable[[Frontend, Any], Awaitable[AsyncIterator[str]]] | None = None) -> Response:
    deadline = lifecycle.deadline()
    try:
        _authorize(frontend, request)
        body = await _read_body(request, frontend, model)
        session = request.headers.get(SESSION_HEADER)
        if session:
            _set_session(body, session)
        if run_stream is not None and getattr(body, "stream", False):
            events = await run_stream(frontend, body)
            frontend.metrics.observe_http(route, 200)
            guarded = lifecycle.guard_stream(events, deadline, _error_event(route))
            return StreamingResponse(_counting_errors(guarded, frontend.metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await lifecycle.run(run(frontend, body), deadline, _until_disconnect(request))
        if result is None:  # the client went away; nobody reads this response
            frontend.metrics.observe_http(route, 499)
            return Response(status_code=499)
        frontend.metrics.observe_http(route, 200)
        return JSONResponse(result)
    except ApiError as err:
        frontend.metrics.observe_http(route, err.status)
        return _error_response(request, err)


POST_ROUTES: dict[str, tuple[Any, Callable[..., Awaitable[dict[str, Any]]], Callable[..., Any] | None]] = {
    "/v1/completions": (CompletionRequest, completion, completion_stream),
    "/v1/chat/completions": (ChatCompletionRequest, chat_completion, chat_completion_stream),
    "/v1/messages": (MessagesRequest, create_message, create_message_stream),
    "/v1/messages/count_tokens": (CountTokensRequest, count_tokens, None),
    "/tokenize": (TOKENIZE_REQUEST, tokenize, None),
    "/detokenize": (DetokenizeRequest, detokenize, None),
}
"""Path -> (request model, the handler, the streaming handler or None) of every JSON POST route."""


def _post_route(frontend: Frontend, lifecycle: Lifecycle, path: str, model: Any,
                run: Callable[..., Awaitable[dict[str, Any]]],
                run_stream: Callable[..., Any] | None) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await _handle(frontend, lifecycle, request, path, model, run, run_stream)

    return endpoint


def build_app(frontend: Frontend, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The ASGI app over a started `Frontend` (its engine client already running); `lifecycle` (default: one from
    the frontend's config) is what `serve` drains on SIGTERM."""
    if lifecycle is None:
        lifecycle = Lifecycle(request_timeout_s=frontend.config.request_timeout_s,
                              shutdown_timeout_s=frontend.config.shutdown_timeout_s)
    app = FastAPI(title="deltaserve", version=VERSION)
    app.state.lifecycle = lifecycle
    app.add_middleware(AdmissionGate, lifecycle=lifecycle, render=_error_for_path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error_response(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and methods (405) get the same error body as every other failure.
        return _error_response(request, ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        frontend.metrics.observe_http(request.url.path, 500)
        return _error_response(request, ApiError(500, f"internal server error: {type(exc).__name__}"))

    for path, (model, run, run_stream) in POST_ROUTES.items():
        app.add_api_route(path, _post_route(frontend, lifecycle, path, model, run, run_stream), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(frontend, request)
        return JSONResponse({"object": "list", "data": [{
            "id": frontend.model_name, "object": "model", "created": int(time.time()), "owned_by": "deltaserve",
            "root": frontend.model_root, "parent": None, "max_model_len": frontend.max_model_len}]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        _authorize(frontend, request)
        await frontend.client.get_stats(reset_prefix_cache=True)
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        problem = _engine_problem(frontend)
        if problem is None:
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    @app.get("/metrics")
    async def metrics() -> Response:
        await frontend.metrics.refresh_engine_stats(frontend.client.get_stats)  # the last snapshot during a long step
        return Response(generate_latest(frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if isinstance(frontend.client, DPEngineClient):
        frontend.metrics.registry.register(ReplicaCollector(frontend.model_name, frontend.client.replica_status))
    app.include_router(status_router(frontend, VERSION))  # /status, /status.json
    return app


def _set_session(body: Any, session: str) -> None:
    """The header's session id in the body field the route reads it from (OpenAI `user`, Anthropic
    `metadata.user_id`)."""
    if isinstance(body, SamplingFields):
        body.user = session
    elif isinstance(body, MessagesRequest):
        body.metadata = {**(body.metadata or {}), "user_id": session}


def _is_type_error(exc: ValidationError) -> bool:
    """Wrong JSON types / missing fields -> 422; values out of range are 400 like the OpenAI API."""
    return any(e.get("type", "").endswith(("_type", "missing", "_parsing")) for e in exc.errors())


def _engine_problem(frontend: Frontend) -> str | None:
    """Why the engine cannot serve now (None: it can): gone, or silent for longer than --health-timeout-s."""
    client = frontend.client
    if not client.is_alive:
        return "the engine process is not running"
    if isinstance(client, AsyncEngineClient | DPEngineClient):  # an in-process engine has no heartbeat
        age, limit = client.heartbeat_age(), frontend.config.health_timeout_s
        if age > limit:
            return f"no heartbeat from the engine process for {age:.1f} s (limit {limit:g} s): stopped or frozen"
    return None


def default_model_name(model_dir: str) -> str:
    return Path(model_dir).resolve().name
