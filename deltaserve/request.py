"""`Request`: one sequence being generated, tracked by `num_tokens` and `num_computed_tokens` (no phases)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deltaserve.config.kv_transfer import RemotePrefill
from deltaserve.multimodal.inputs import ImageInput, keyed_tokens
from deltaserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An end-of-sequence token, a stop token id or a stop string."""
    LENGTH = "length"
    """max_tokens, or the model's length limit."""
    ABORT = "abort"
    """Cancelled by the client."""
    ERROR = "error"
    """The engine could not serve the request: its structured-output grammar failed to compile, or the grammar
    rejected a sampled token. `EngineCoreOutput.error` says why; no cache is held."""


@dataclass(slots=True, kw_only=True)
class Request:
    """A single output sequence (a request with n > 1 becomes n of these). Mutated only by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    """Token ids that finish the sequence once min_tokens exist: eos (unless ignore_eos) plus params.stop_token_ids."""
    arrival_index: int
    """Monotonic arrival counter: the FCFS order."""
    priority: int = 0
    """Lower runs first under the 'priority' policy."""
    max_total_tokens: int
    """Prompt + output may not exceed this (max_model_len)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV and state are in the cache; catches up to num_tokens."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at first admission (None until admitted)."""
    skip_prefix_cache: bool = False
    """Compute the whole prompt: no prefix-cache hit, and no waiting for another request's prefix (set by the engine,
    e.g. for a request that wants prompt logprobs, which need every prompt position to run through the model)."""
    kv_send: str | None = None
    """Prefill/decode disaggregation, prefill side: the transfer id under which this request's cache (KV blocks and
    KDA state after its prompt) is published once its prompt is computed."""
    remote_prefill: RemotePrefill | None = None
    """Decode side: where a prefill instance holds this request's cache for its first `num_tokens` prompt tokens."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, in prompt order: their placeholder tokens take the images' features."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens (speculative decoding), set before `schedule()` and cleared by the step that verifies
    them; the scheduler may verify fewer (budget, length limits)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens_needed(self) -> int:
        """Tokens whose KV may have to be cached before this request finishes (its last token never is)."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_total_tokens) - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def cache_token_slice(self, start: int, end: int) -> list[int]:
        """`token_slice`, with each image placeholder token replaced by its image's `cache_token`: what prefix-cache
        keys hash, so that cached blocks and states over an image are found only for the same image."""
        return keyed_tokens(self.token_slice(start, end), self.images, start)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
