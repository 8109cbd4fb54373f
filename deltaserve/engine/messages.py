"""The wire protocol between the API process (`AsyncEngineClient`) and the engine process (`core_proc`).

Two ZMQ PUSH/PULL channels carry msgpack-encoded msgspec Structs, each tagged with its type:

- input (client -> engine): `AddRequest`, `AbortRequest`, `StatsRequest`, `ShutdownRequest`;
- output (engine -> client): `Ready` or `StartupError` once, then `OutputBatch` (one per step that produced
  anything), `StatsReply`, and `FatalError` just before an engine that failed exits; and a `Heartbeat` every
  `HEARTBEAT_INTERVAL_S` from a thread of the engine process (its own PUSH socket to the same address).

No torch here: the API process imports this module without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from deltaserve.engine.stats import EngineStats
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.outputs import TokenLogprobs
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    """Facts about the loaded model and cache, sent once by the engine when it is ready."""

    max_model_len: int
    """Prompt + output tokens of one request, at most."""
    vocab_size: int
    eos_token_ids: frozenset[int]
    """The model config's end-of-sequence ids (the frontend adds the tokenizer's own)."""
    num_blocks: int
    """MLA KV blocks in the pool."""
    num_state_slots: int
    """KDA state slots for running requests (the most requests that can hold cache at once)."""
    block_size: int
    """Tokens per KV block."""


# -- client -> engine ----------------------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", frozen=True, kw_only=True):
    """Queue one sequence (the frontend fans n out, so `params.n` is 1)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation (vLLM's field): `{"do_remote_decode": true}` on a prefill instance, or the
    object a prefill instance returned, on a decode instance."""
    images: list[ImageInput] = []
    """The prompt's preprocessed images (msgpack-native: the pixels travel as one bin field each)."""


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """End a request now and free its cache: ABORT when the client went away, STOP when the frontend found a stop
    string. Unknown or finished ids are ignored."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT


class StatsRequest(msgspec.Struct, tag="stats", frozen=True, kw_only=True):
    """Ask for an `EngineStats` snapshot; answered by a `StatsReply` with the same `request_no`."""

    request_no: int
    reset_prefix_cache: bool = False
    """First forget every cached KV block and state checkpoint (benchmarks flush between rounds)."""


class ShutdownRequest(msgspec.Struct, tag="shutdown", frozen=True):
    """Exit the engine loop (requests still in flight are dropped)."""


EngineInput = AddRequest | AbortRequest | StatsRequest | ShutdownRequest


# -- engine -> client ----------------------------------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """One request's progress in one step, or its end by an error (`error` set, `finish_reason` ERROR): what
    `EngineCore.step` returns and what crosses the wire to the client unchanged."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """One per new token; None where logprobs were not requested."""
    finish_reason: FinishReason | None = None
    """Set on the request's last output."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    error: str | None = None
    """Why the engine rejected the request (bad prompt or params: it never ran) or ended it (its grammar failed
    to compile or rejected a token); None otherwise."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On the first output of a request with params.prompt_logprobs: one per prompt token after the first."""
    kv_transfer_params: dict[str, Any] | None = None
    """On the last output of a prefill instance's request (kv_transfer_params.do_remote_decode): where a decode
    instance fetches its cache (`config.kv_transfer.RemotePrefill.as_params`)."""


class Ready(msgspec.Struct, tag="ready", frozen=True, kw_only=True):
    """The engine built its model and cache and is waiting for requests."""

    info: EngineInfo


class StartupError(msgspec.Struct, tag="startup_error", frozen=True, kw_only=True):
    """Building the engine failed; the process exits after sending this."""

    message: str
    """The exception, one line ("FileNotFoundError: ...")."""
    traceback: str = ""


class OutputBatch(msgspec.Struct, tag="outputs", frozen=True, kw_only=True):
    """Everything one engine step produced (plus requests rejected since the previous step)."""

    outputs: list[EngineCoreOutput]
    step: int
    """The engine's step counter after this step."""


class StatsReply(msgspec.Struct, tag="stats", frozen=True, kw_only=True):
    request_no: int
    stats: EngineStats


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True, kw_only=True):
    """The engine process is running (not frozen or stopped). Sent by a thread independent of the step loop, so a
    long step does not delay it."""

    step: int
    """The engine's step counter when it was sent."""


HEARTBEAT_INTERVAL_S = 0.5
"""How often the engine process sends a `Heartbeat`."""


class FatalError(msgspec.Struct, tag="fatal", frozen=True, kw_only=True):
    """The engine loop failed unexpectedly; the process exits after sending this."""

    message: str
    """The exception, one line."""
    traceback: str = ""


EngineOutput = Ready | StartupError | OutputBatch | StatsReply | Heartbeat | FatalError
