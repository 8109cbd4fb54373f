"""`serve`: start the engine process, then the HTTP server on top of it (what `deltaserve serve` runs)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import uvicorn

from deltaserve.chat import get_chat_format
from deltaserve.config import EngineConfig, ServerConfig
from deltaserve.engine.client import AsyncEngineClient
from deltaserve.entrypoints.server.app import build_app, default_model_name
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.structured.factory import make_backend
from deltaserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


async def build_frontend(engine_config: EngineConfig, server_config: ServerConfig) -> Frontend:
    """Load the tokenizer and chat format (fail fast on a bad checkpoint), then start the engine process."""
    tokenizer = Tokenizer.from_pretrained(engine_config.model)
    chat_format = get_chat_format(engine_config.model, tokenizer, server_config.chat_format)
    name = server_config.served_model_name or default_model_name(engine_config.model)
    structured = make_backend(engine_config.structured_output_backend, tokenizer)  # validates requests up front
    logger.info("starting the engine process for %s (chat format %s)", engine_config.model, chat_format.name)
    client = await AsyncEngineClient.start(engine_config)
    return Frontend(client, tokenizer, chat_format, server_config, ServerMetrics(name), name,
                    max_num_seqs=engine_config.scheduler.max_num_seqs, structured_backend=structured,
                    model_root=str(Path(engine_config.model).resolve()),
                    priority_scheduling=engine_config.scheduler.policy == "priority")


async def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> None:
    """Run until interrupted; the engine process is shut down on exit."""
    frontend = await build_frontend(engine_config, server_config)
    try:
        app = build_app(frontend)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=log_level.lower(),
                                timeout_graceful_shutdown=5, access_log=False)
        server = uvicorn.Server(config)
        logger.info("serving %s on http://%s:%d (OpenAI /v1/chat/completions, /v1/completions; Anthropic "
                    "/v1/messages)", frontend.model_name, server_config.host, server_config.port)
        await server.serve()
    finally:
        await frontend.client.shutdown()


def run(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Blocking entry point (uvloop when installed)."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        runner = asyncio.Runner()
    with runner:
        runner.run(serve(engine_config, server_config, log_level))
    return 0
