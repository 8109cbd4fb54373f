"""`EngineClient`: what a frontend (`LLM`, the HTTP server) needs from an engine, whichever process it runs in.

Three implementations: `AsyncEngineClient` (client.py: the engine in its own process, over ZMQ),
`InprocEngineClient` (inproc_client.py: an `EngineCore` in this process) and `DPEngineClient` (dp_client.py:
data-parallel replicas, each an `AsyncEngineClient`, behind a router). Both stream the engine's own per-step
records (`EngineCoreOutput`) and raise the errors defined here. No torch here.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from deltaserve.engine.messages import EngineCoreOutput, EngineInfo
from deltaserve.engine.stats import EngineStats
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "EngineRequestError"]


class EngineDeadError(RuntimeError):
    """The engine is gone (it failed, was killed, or was shut down)."""


class EngineRequestError(ValueError):
    """The engine rejected this request (bad prompt or parameters) or ended it with an error (its grammar failed to
    compile or rejected a token, or a step failed); the engine itself keeps serving.

    The in-process client chains the engine's own exception (`raise ... from`): the core's ValueError for a
    rejected request, the step's exception for a failed step; None for an error the engine reported as a value."""


class EngineClient(Protocol):
    """An engine seen from asyncio code. Every method is called from the event loop the client lives on.

    Contracts shared by the implementations:
    - `generate` takes n=1 params (the output processor fans n out) and adds the request when iteration starts.
      It yields one `EngineCoreOutput` per engine step that produced something for the request, the last one with
      `finish_reason` set; an aborted request's last output has the abort's reason and no tokens. An output that
      carries `error` is raised as `EngineRequestError` instead. Closing the iterator early (aclose, cancellation,
      garbage collection) aborts the request in the engine.
    - `abort` is idempotent and ignores unknown ids; the request frees its cache before the next step.
    - `session_id` is a routing hint: requests with the same one go to the same data-parallel replica (where their
      cache is). A single engine ignores it.
    """

    info: EngineInfo
    """Facts about the loaded model and cache (limits, vocabulary, eos ids, pool sizes)."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                 kv_transfer_params: dict[str, Any] | None = None, images: tuple[ImageInput, ...] = ()
                 ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Run one sequence; raises EngineRequestError (rejected or failed request), EngineDeadError (engine gone)
        and ValueError (n != 1, or a request id still in use). `kv_transfer_params`: prefill/decode
        disaggregation (`EngineCore.add_request`); `images`: the prompt's preprocessed images."""
        ...

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now (ABORT: its client went away; STOP: the frontend found a stop string)."""
        ...

    async def get_stats(self, *, reset_prefix_cache: bool = False) -> EngineStats:
        """A fresh snapshot, taken between two steps; optionally first forget every cached prefix."""
        ...

    @property
    def is_alive(self) -> bool:
        """False once the engine has died or been shut down."""
        ...

    @property
    def num_unfinished(self) -> int:
        """Requests added through this client that have not finished, failed or been aborted."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and release it; idempotent. Requests still in flight fail with EngineDeadError."""
        ...
