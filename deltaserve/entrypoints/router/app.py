"""The router's HTTP app (routes, /health, /metrics) and `run_router`, which serves it with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as StarletteRoute

from deltaserve.entrypoints.router.bodies import ROUTES, Route
from deltaserve.entrypoints.router.config import RouterConfig
from deltaserve.entrypoints.router.health import check_all, run_health_checks
from deltaserve.entrypoints.router.instances import InstancePool, Pools
from deltaserve.entrypoints.router.metrics import RouterMetrics
from deltaserve.entrypoints.router.proxy import Proxy, Upstream, forwarded_headers
from deltaserve.utils.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

# Idle pooled connections are dropped before uvicorn's 5 s keep-alive timeout closes them from the other side: a
# request sent on a connection the instance is closing would fail like an instance that died.
_KEEPALIVE_EXPIRY_S = 2.0


def build_app(config: RouterConfig) -> Starlette:
    """The router as an ASGI app; its lifespan opens the HTTP client, checks every instance once and starts the
    periodic health checks."""
    pools = Pools(prefill=InstancePool("prefill", config.prefill_urls),
                  decode=InstancePool("decode", config.decode_urls))
    metrics = RouterMetrics(pools)
    state: dict[str, Proxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=_KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
            state["proxy"] = Proxy(config.timeouts, pools, metrics, client)
            await check_all(client, pools, config.timeouts.health_timeout_s)
            logger.info("router: %d/%d prefill and %d/%d decode instances healthy", pools.prefill.num_healthy,
                        len(pools.prefill), pools.decode.num_healthy, len(pools.decode))
            checks = asyncio.create_task(run_health_checks(client, pools, config.timeouts.health_interval_s,
                                                           config.timeouts.health_timeout_s))
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks

    def proxied(route: Route) -> StarletteRoute:
        async def endpoint(request: Request) -> Response:
            raw = await request.body()
            return await _unless_disconnected(request, state["proxy"].handle(route, raw, request.headers))

        return StarletteRoute(route.path, endpoint, methods=["POST"])

    async def models(request: Request) -> Response:
        metrics.requests.labels("/v1/models").inc()
        upstream = Upstream(method="GET", path="/v1/models", content=b"", headers=forwarded_headers(request.headers))
        return await state["proxy"].decode(ROUTES[0], upstream, stream=False)

    async def health(request: Request) -> Response:
        body: dict[str, Any] = {pool.role: {"healthy": pool.num_healthy, "total": len(pool)}
                                for pool in (pools.prefill, pools.decode)}
        return JSONResponse(body, status_code=200 if pools.decode.num_healthy else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [proxied(route) for route in ROUTES]
    routes += [StarletteRoute("/v1/models", models, methods=["GET"]),
               StarletteRoute("/health", health, methods=["GET"]),
               StarletteRoute("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


async def _unless_disconnected(request: Request, handling: Awaitable[Response]) -> Response:
    """`handling`'s response, or (the client left first) cancel it, which closes the requests to the instances so
    they abort theirs. A stream's own disconnect is seen by the streamed response."""
    task = asyncio.ensure_future(handling)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody reads it


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    """Serve the router on config.host:config.port until SIGINT or SIGTERM."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request and per health check
    server = uvicorn.Server(uvicorn.Config(build_app(config), host=config.host, port=config.port,
                                           log_level=log_level.lower(), access_log=False))
    freeze_startup_heap()  # the router relays bodies as large as a server's: the same full-collection pauses
    server.run()
    return 0
