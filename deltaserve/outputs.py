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
    """"stop" (eos, a stop token or a stop string), "length" (max_tokens), "abort", or None while running."""
    logprobs: list | None = None
    """Per generated token a `TokenLogprobs` (sampled token, rank, top alternatives) when requested."""


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """A request's prompt and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (KV blocks and a KDA state checkpoint) instead of computed."""
    prompt_logprobs: list | None = None
    """With `SamplingParams.prompt_logprobs`: None for the first prompt token, then a `TokenLogprobs` per token
    (its logprob given the tokens before it, its rank and the top alternatives), as vLLM's list starts with None."""
