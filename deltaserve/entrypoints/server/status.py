"""The live status page: `GET /status` (HTML, `status_page.html`) and `GET /status.json` (`StatusBoard`).

The page is one self-contained HTML file with an inline script (no external assets, so it works offline) that polls
`/status.json` every few seconds and draws its charts as inline SVG. The router's lifespan runs a background task
that, every `interval_s`, refreshes the engine stats snapshot (waiting at most a moment: a long step never holds it
up) and appends a history sample, so the charts have a past when the page is opened. Like `/metrics` and `/health`,
both routes are open without the API key: they show counts and latencies, no request content. With data
parallelism the engine numbers are the replicas' sums and `data_parallel.replicas` lists each replica (engine
process id, alive, requests in flight and routed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from deltaserve.engine.dp_client import DPEngineClient
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.entrypoints.server.status_board import StatusBoard

logger = logging.getLogger(__name__)

_NO_CACHE = {"Cache-Control": "no-store"}


def status_page() -> str:
    """The page's HTML (package data next to this module)."""
    return resources.files(__package__).joinpath("status_page.html").read_text(encoding="utf-8")


def status_router(frontend: Frontend, version: str, *, interval_s: float = 2.0) -> APIRouter:
    """The /status and /status.json routes of one server, with the sampling task in the router's lifespan
    (FastAPI merges it into the app's when the router is included)."""
    board = StatusBoard(frontend.metrics, model_name=frontend.model_name, version=version, interval_s=interval_s)
    page = status_page()

    async def sample_forever() -> None:
        while True:
            try:
                await frontend.metrics.refresh_engine_stats(frontend.client.get_stats, wait_s=interval_s)
                board.sample()
            except Exception:  # a bug here must not end the sampling (nor the server)
                logger.exception("status sample failed")
            await asyncio.sleep(interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        task = asyncio.create_task(sample_forever(), name="deltaserve-status-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    router = APIRouter(lifespan=lifespan)

    @router.get("/status")
    async def status() -> HTMLResponse:
        return HTMLResponse(page, headers=_NO_CACHE)

    @router.get("/status.json")
    async def status_json() -> JSONResponse:
        await frontend.metrics.refresh_engine_stats(frontend.client.get_stats)
        body = board.to_json(engine_alive=frontend.client.is_alive)
        if isinstance(frontend.client, DPEngineClient):  # the engine numbers above are the replicas' sums
            body["data_parallel"] = {"replicas": frontend.client.replica_status()}
        return JSONResponse(body, headers=_NO_CACHE)

    return router
