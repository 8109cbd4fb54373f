"""What `LLM.generate` returns (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (eos or a stop token), "length" (max_tokens), or None while running."""


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """A request's prompt and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
