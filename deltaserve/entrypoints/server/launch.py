"""`serve`: start the engine process, then the HTTP server on top of it (what `deltaserve serve` runs).

Signals: the first SIGTERM drains (server/lifecycle.py: new requests get 503, those in flight get
`--shutdown-timeout-s`, then the server exits with status 0); SIGINT, or a second SIGTERM, is uvicorn's
immediate shutdown. When the engine process dies, its requests fail (503, or an error event in a stream); the
server then exits with status 1 for a supervisor to restart it, or with `--restart-engine` starts a new engine
process and goes on serving.

With `--data-parallel-size N` there are N engine processes behind a router (engine/dp_client.py). One that dies
fails only its own requests and the others go on serving; the server exits with status 1 once every replica is
dead, and `--restart-engine` restarts each replica as it dies.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from types import FrameType

import uvicorn

from deltaserve.chat import get_chat_format
from deltaserve.config import EngineConfig, ServerConfig
from deltaserve.engine.client import AsyncEngineClient, EngineDeadError, EngineStartError
from deltaserve.engine.dp_client import DPEngineClient
from deltaserve.entrypoints.server.app import build_app, default_model_name
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.entrypoints.server.http_protocol import with_header_timeout
from deltaserve.entrypoints.server.lifecycle import Lifecycle
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.structured.factory import make_backend
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.utils.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


async def build_frontend(engine_config: EngineConfig, server_config: ServerConfig) -> Frontend:
    """Load the tokenizer and chat format (fail fast on a bad checkpoint), then start the engine process."""
    tokenizer = Tokenizer.from_pretrained(engine_config.model)
    chat_format = get_chat_format(engine_config.model, tokenizer, server_config.chat_format)
    name = server_config.served_model_name or default_model_name(engine_config.model)
    structured = make_backend(engine_config.structured_output_backend, tokenizer)  # validates requests up front
    replicas = engine_config.parallel.data_parallel_size
    logger.info("starting the engine process%s for %s (chat format %s)", "es" if replicas > 1 else "",
                engine_config.model, chat_format.name)
    client: AsyncEngineClient | DPEngineClient = (
        await DPEngineClient.start(engine_config) if replicas > 1 else await AsyncEngineClient.start(engine_config))
    return Frontend(client, tokenizer, chat_format, server_config, ServerMetrics(name), name,
                    max_num_seqs=engine_config.scheduler.max_num_seqs * replicas, structured_backend=structured,
                    model_root=str(Path(engine_config.model).resolve()),
                    priority_scheduling=engine_config.scheduler.policy == "priority")


async def _restart_replica(client: DPEngineClient, index: int, server: _Server) -> None:
    """Restart data-parallel replica `index` each time its engine process exits; stop the server with status 1 when
    a restart fails and no replica is left."""
    replica = client.replicas[index]
    while True:
        reason = await replica.wait_exited()
        if server.should_exit:
            return
        logger.error("replica %d: %s: starting a new engine process", index, reason)
        try:
            await client.restart_replica(index)
        except EngineDeadError:  # shutting down meanwhile
            return
        except EngineStartError:
            if client.is_alive:
                logger.exception("replica %d failed to restart; the other replicas go on serving", index)
                return
            logger.exception("replica %d failed to restart and no replica is left: the server exits with status 1",
                             index)
            server.stop(1)
            return


class _Server(uvicorn.Server):
    """uvicorn's server, with a drain on the first SIGTERM and an exit status."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.lifecycle.draining and not self.should_exit:
            # Not recorded in uvicorn's captured signals: it would raise SIGTERM again on exit (status -15, not 0).
            self.lifecycle.draining = True  # refuse new requests from now on, before the drain task even runs
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        logger.info("SIGTERM: draining (at most %g s), then exiting", self.lifecycle.shutdown_timeout_s)
        self._drain = asyncio.ensure_future(self.lifecycle.drain(self.stop))

    def stop(self, exit_code: int = 0) -> None:
        self.exit_code = max(self.exit_code, exit_code)
        self.should_exit = True


async def _watch_engine(client: AsyncEngineClient | DPEngineClient, server: _Server, restart: bool) -> None:
    """When the engine process exits: stop the server with status 1, or (`restart`) start a new engine. Data
    parallelism: status 1 once every replica has exited; with `restart`, each replica is restarted as it exits."""
    if isinstance(client, DPEngineClient):
        if restart:
            await asyncio.gather(*(_restart_replica(client, i, server) for i in range(len(client.replicas))))
            return
        reason = await client.wait_exited()
        if not server.should_exit:
            logger.error("%s: the server exits with status 1 (--restart-engine restarts the engine instead)", reason)
            server.stop(1)
        return
    while True:
        reason = await client.wait_exited()
        if server.should_exit:
            return
        if not restart:
            logger.error("%s: the server exits with status 1 (--restart-engine restarts the engine instead)", reason)
            server.stop(1)
            return
        logger.error("%s: starting a new engine process", reason)
        try:
            await client.restart()
        except EngineDeadError:  # shutting down meanwhile
            return
        except EngineStartError:
            logger.exception("the new engine process failed to start: the server exits with status 1")
            server.stop(1)
            return


async def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Run until interrupted, drained or the engine died; the engine process is shut down on exit. The exit status:
    0, or 1 after the engine process died (without --restart-engine)."""
    frontend = await build_frontend(engine_config, server_config)
    client = frontend.client
    assert isinstance(client, AsyncEngineClient | DPEngineClient)
    watcher: asyncio.Task[None] | None = None
    try:
        lifecycle = Lifecycle(request_timeout_s=server_config.request_timeout_s,
                              shutdown_timeout_s=server_config.shutdown_timeout_s)
        app = build_app(frontend, lifecycle)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=log_level.lower(),
                                timeout_graceful_shutdown=5, access_log=False,
                                http=with_header_timeout(server_config.header_timeout_s))
        server = _Server(config, lifecycle)
        watcher = asyncio.ensure_future(_watch_engine(client, server, server_config.restart_engine))
        freeze_startup_heap()
        logger.info("serving %s on http://%s:%d (OpenAI /v1/chat/completions, /v1/completions; Anthropic "
                    "/v1/messages)", frontend.model_name, server_config.host, server_config.port)
        await server.serve()
        return server.exit_code
    finally:
        if watcher is not None:
            watcher.cancel()
        await client.shutdown()


def run(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Blocking entry point (uvloop when installed); the process's exit status."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve(engine_config, server_config, log_level))
