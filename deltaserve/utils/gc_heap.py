"""`freeze_startup_heap`: keep the garbage collector's full passes off what a server loaded at start-up."""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, the tokenizer, the app) to the permanent
    generation, which the collector never traverses (vLLM's API server does the same). A request that allocates
    many objects (8 MB of small chat messages: ~10 objects per message) triggers full collections, each of which
    would otherwise walk the whole start-up heap while holding the GIL: ~100-150 ms pauses of the event loop, 15-20
    ms frozen (measured while parsing, validating and rendering 42,000 messages)."""
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects out of the garbage collector's passes", gc.get_freeze_count())
