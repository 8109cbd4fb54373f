"""What the scheduler hands the runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltaserve.cache.host_tier import HostCopies
from deltaserve.cache.manager import SharedStoreOps
from deltaserve.cache.remote import RemoteFetch, TransferResult
from deltaserve.kvstore.store import KVStoreStats
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.outputs import TokenLogprobs
from deltaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the runner keeps for sampling."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    images: tuple[ImageInput, ...] = ()
    """The prompt's images: the runner puts their features in place of their placeholder tokens' embeddings."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """The tokens of one sequence to compute this step and where its cache lives."""

    request_id: str
    new_token_ids: list[int]
    num_computed_tokens: int
    """Tokens of this sequence already cached (the new ones follow them)."""
    state_slot: int
    block_ids: list[int]
    """KV blocks covering at least num_computed_tokens + len(new_token_ids) tokens."""
    reset_state: bool = False
    """Zero the state slot first: the sequence (re)starts from token 0."""
    sample: bool = True
    """The chunk reaches the end of the known tokens, so a token is sampled after it."""
    checkpoints: tuple[tuple[int, int], ...] = ()
    """(position within this chunk, checkpoint slot): save the KDA state after that many of its tokens (prefix-cache
    checkpoints, and the scratch states of a speculative step)."""
    num_proposed: int = 0
    """The chunk's last `num_proposed` tokens are proposed, not yet sampled (speculative decoding): the runner returns
    logits for the chunk's last 1 + num_proposed positions and verifies them; `sample` is set."""
    kv_send: str | None = None
    """Disaggregation, prefill side: the chunk ends the request's prompt; after the forward, publish the cache of
    its blocks and state slot (all `num_computed_tokens + len(new_token_ids)` tokens) under this transfer id."""

    @property
    def is_decode(self) -> bool:
        """One new token after cached ones, with no checkpoint to save: the runner's recurrent decode row."""
        return len(self.new_token_ids) == 1 and self.num_computed_tokens > 0 and not self.checkpoints


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """One step's work."""

    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests finished or aborted since the last step: the runner drops their sampling state."""
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)
    """(src block, dst block, rows): copy the first rows of a cached partial block before the forward."""
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src slot, dst slot): copy a checkpoint's KDA state into a running slot before the forward."""
    host_copies: HostCopies | None = None
    """Copies to and from the host tier, before `block_copies` and `state_copies`; None when there are none."""
    shared_ops: SharedStoreOps | None = None
    """Puts to and fetches from the shared store, before everything else; None when there are none."""
    remote_fetches: list[RemoteFetch] = field(default_factory=list)
    """Disaggregation, decode side: caches to fetch from prefill instances into the host tier, before the host
    copies."""
    structured_request_ids: list[str] = field(default_factory=list)
    """Sampling requests constrained by a grammar this step, in the row order of `grammar_bitmask`. Filled by the
    engine (its StructuredOutputManager) after `schedule()`; empty when no sampled row is constrained."""
    grammar_bitmask: torch.Tensor | None = None
    """CPU int32 ``[R, ceil(vocab / 32)]``: bit j of word w allows token 32 * w + j (set by the engine; the scheduler
    itself needs no torch). Each request of `structured_request_ids` has 1 + its chunk's `num_proposed` rows, in
    order: the tokens allowed at each position of its verification, given the proposals before it. None when
    `structured_request_ids` is empty."""
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per request whose proposals were drawn from a distribution: ``[num_proposed, vocab]`` fp32, row j the
    distribution of proposal j (rejection sampling). Requests missing here verify deterministic proposals (or, with
    a block drafter, the distributions its runner kept)."""
    propose_drafts: bool = True
    """Block drafter: draft the next tokens of this step's sampled requests after sampling (False: the engine's
    adaptive verification found speculation not worth its cost at this load)."""
    draft_only: tuple[str, ...] | None = None
    """Block drafter, with `propose_drafts`: draft only for these requests (adaptive verification's probes: one
    request's drafts keep its acceptance rates current for a fraction of a whole batch's drafter forward); None:
    every sampled request."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.new_token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token and, when requested, its log-probabilities."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class BlockDraft:
    """A block drafter's proposal for a request's next step, made on the workers right after this step sampled."""

    token_ids: tuple[int, ...]
    """The drafts, continuing the request's tokens after this step."""
    confidences: tuple[float, ...]
    """Per draft, the drafter's probability of it (what adaptive verification weighs)."""
    num_tokens: int
    """The request's tokens (prompt and output) the drafts continue: they apply only while it has exactly these."""


@dataclass(frozen=True, slots=True)
class EncoderStepStats:
    """What the vision side did in one step."""

    images_encoded: int = 0
    """Images the vision tower ran on."""
    cache_hits: int = 0
    """Images of the step's chunks whose features the encoder cache held (one lookup per image per step)."""
    seconds: float = 0.0
    """Time in the vision tower and projector."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerOutput:
    """What one executed step produced: tokens for every chunk with `sample` set."""

    sampled: dict[str, list[SampledToken]]
    """Per sampling request, in order: the proposed tokens the verification accepted, then one sampled token (a
    plain step: just that one). So `len - 1` proposed tokens were accepted."""
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Per request that asked for them, the `TokenLogprobs` of the prompt positions this step computed (in order;
    the first prompt token has none)."""
    forward_seconds: float = 0.0
    """Time spent in the model forward and LM head (the rest of a step is scheduling/batching/sampling overhead)."""
    host_copy_seconds: float = 0.0
    """Time spent copying to and from the host tier before the forward."""
    shared_fetched: list[bool] = field(default_factory=list)
    """Per fetch of `SchedulerOutput.shared_ops`, in order: whether every rank got its part (checked entries)."""
    shared_store: KVStoreStats | None = None
    """Rank 0's shared-store counters so far (cumulative; None without a store): gets, hits, bytes, latency."""
    transfer: TransferResult | None = None
    """The step's disaggregation transfers (None when it had none)."""
    encoder: EncoderStepStats = EncoderStepStats()
    """The step's image encoding."""
    drafts: dict[str, BlockDraft] = field(default_factory=dict)
    """Block drafter: per sampled request, the drafts of its next step."""
