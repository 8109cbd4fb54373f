"""The `Proposer` protocol: what the engine asks for the next tokens of its decoding requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deltaserve.request import Request
from deltaserve.scheduler.output import BlockDraft

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Proposal:
    """The proposed next tokens of one request and, for drafts sampled from a distribution, that distribution."""

    token_ids: list[int]
    """Tokens continuing the request's `prompt_token_ids + output_token_ids`, at most `num_speculative_tokens`."""
    probs: torch.Tensor | None = None
    """``[len(token_ids), vocab]`` fp32 CPU: the distribution each token was drawn from (rejection sampling accepts
    token j with probability min(1, p/q)). None: the tokens are deterministic (n-gram lookup, greedy drafts), verified
    by sampling the target as plain decoding would and accepting while it agrees (a block drafter's sampled drafts:
    their distributions stay on the workers, which verify against them)."""
    confidences: tuple[float, ...] | None = None
    """Per token, the proposer's probability that it is right (a block drafter's; None: unknown). Adaptive
    verification weighs them."""


class Proposer(Protocol):
    """Proposes up to `num_speculative_tokens` next tokens per request, before each step.

    The engine asks only for running requests whose next step is a decode (every known token but the last is
    computed). A request may get fewer or no proposals: its step is then a plain decode. The target model verifies
    proposals in the same step, so a proposer never changes what greedy decoding generates, nor the distribution of
    sampled outputs.
    """

    @property
    def num_speculative_tokens(self) -> int:
        """The most tokens proposed for one request in one step (sizes the scratch state slots)."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Device memory the proposer holds (a draft model's weights and caches; 0 for a lookup): the engine takes it
        out of the cache budget and logs it."""
        ...

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        """Proposals by request id (missing or empty: none)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop what the proposer keeps for it (unknown ids are ignored)."""
        ...


@runtime_checkable
class WorkerDraftedProposer(Proposer, Protocol):
    """A proposer whose drafts are made on the workers after each step (a block drafter): the engine hands it every
    step's `RunnerOutput.drafts`."""

    def receive(self, drafts: Mapping[str, BlockDraft]) -> None:
        """The drafts a step made, by request id (they replace the requests' earlier ones)."""
        ...
