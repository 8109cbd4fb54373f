"""`SpecDecodeStats`: cumulative acceptance counters of speculative decoding (vLLM's spec-decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since the engine started, updated once per request and step that verified proposed tokens."""

    num_drafts: int = 0
    """Request-steps that verified at least one proposed token."""
    num_draft_tokens: int = 0
    """Proposed tokens verified."""
    num_accepted_tokens: int = 0
    """Proposed tokens the target model accepted."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Index j: drafts whose proposed token j (0-based) was accepted (so non-increasing in j)."""

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verification in one step: `num_accepted` of its `num_proposed` tokens were kept (a prefix
        of them). A step without proposed tokens is not a draft and is ignored."""
        if num_proposed <= 0:
            return
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"num_accepted={num_accepted} must be in 0..num_proposed={num_proposed}")
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per draft, the bonus (sampled) token included: 1 + accepted / drafts (vLLM's definition);
        1.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the proposed tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
