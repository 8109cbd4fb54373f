"""The `Proposer` protocol: what the engine asks for the next tokens of its decoding requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from deltaserve.request import Request


class Proposer(Protocol):
    """Proposes up to `num_speculative_tokens` next tokens per request, before each step.

    The engine asks only for running requests whose next step is a decode (every known token but the last is
    computed) and that no grammar constrains. A request may get fewer or no proposals: its step is then a plain
    decode. The target model verifies proposals in the same step, so a proposer never changes what is generated.
    """

    @property
    def num_speculative_tokens(self) -> int:
        """The most tokens proposed for one request in one step (sizes the scratch state slots)."""
        ...

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Proposed next tokens by request id (missing or empty: none); they continue the request's
        `prompt_token_ids + output_token_ids`."""
        ...
