"""Output records shared by every layer: a token's logprobs (made by the sampler, carried over the engine's wire,
rendered by the APIs) and what `LLM.generate` returns (vLLM-compatible shapes). No torch here."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of one token, from the raw logits (log_softmax before penalties, temperature and filters)."""

    token_id: int
    logprob: float
    """Of this token."""
    rank: int
    """1 + the number of tokens with a strictly higher logprob (1 = most likely)."""
    top: tuple[tuple[int, float], ...]
    """The ``params.logprobs`` most likely ``(token id, logprob)`` pairs, best first (empty for logprobs=0)."""


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (eos, a stop token or a stop string), "length" (max_tokens), "abort", or None while running."""
    logprobs: list[TokenLogprobs | None] | None = None
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
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With `SamplingParams.prompt_logprobs`: None for the first prompt token, then a `TokenLogprobs` per token
    (its logprob given the tokens before it, its rank and the top alternatives), as vLLM's list starts with None."""
