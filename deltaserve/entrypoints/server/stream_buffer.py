"""`bounded_stream`: a streaming response's updates, with a bound on what a client that stops reading leaves unread.

An SSE response is written as fast as the client reads it: when the client stops reading, the socket buffers fill,
uvicorn's `send` waits, and the response generator stops pulling. The engine does not stop with it, so without a
bound its output would pile up in the engine client's per-request queue until `max_tokens` (a whole context per
stalled client). Here a task of its own pulls the updates into a buffer the response drains and counts the generated
tokens waiting there; past the limit it ends the request (which aborts its sequences in the engine and frees their
cache), logs why, and the response ends with an error event should the client ever read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from deltaserve.engine.output_processor import SequenceUpdate
from deltaserve.entrypoints.server.errors import ApiError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _End:
    """The buffer's last item: the stream ended, with this error or cleanly (None)."""

    error: BaseException | None = None


async def bounded_stream(updates: AsyncGenerator[SequenceUpdate, None], *, max_unread_tokens: int,
                         request_id: str) -> AsyncGenerator[SequenceUpdate, None]:
    """Yield `updates` as they come; abort the request once more than `max_unread_tokens` generated tokens (each
    update counts at least one) wait unread. Closing this generator closes `updates` (aborting what still runs)."""
    queue: asyncio.Queue[SequenceUpdate | _End] = asyncio.Queue()
    unread = 0

    async def pump() -> None:
        nonlocal unread
        try:
            async with contextlib.aclosing(updates):
                async for update in updates:
                    unread += max(1, len(update.token_ids))
                    queue.put_nowait(update)
                    if unread > max_unread_tokens:
                        logger.warning("request %s aborted: its client left %d generated tokens unread (the limit "
                                       "is %d, --max-unread-stream-tokens)", request_id, unread, max_unread_tokens)
                        queue.put_nowait(_End(ApiError(
                            408, f"the stream was aborted: the client left more than {max_unread_tokens} generated "
                                 "tokens unread", code="stream_not_read")))
                        return  # leaving the `async with` closes `updates`: the engine aborts the sequences
            queue.put_nowait(_End())
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(_End(exc))

    task = asyncio.create_task(pump(), name=f"stream-{request_id}")
    try:
        while True:
            item = await queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            unread -= max(1, len(item.token_ids))
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
