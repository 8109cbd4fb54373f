"""`SamplingParams`: per-request decoding settings, vLLM-compatible names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError naming the field."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Seed of this request's own random generator (reproducible whatever else runs)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end generation (the stop token is kept in the output ids)."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence tokens."""
    min_tokens: int = 0
    """Do not stop (on eos or stop ids) before this many tokens."""
    skip_special_tokens: bool = True
    """Drop special tokens from the output text."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
