"""`SpeculativeConfig`: which proposer drafts the next tokens, and how many (vLLM's `--speculative-config` JSON).

Each error is one line naming its field (`speculative_config.num_speculative_tokens must be ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from deltaserve.config.fields import check_known_fields, parse_json_object

METHODS = ("ngram", "draft_model", "dspark", "dflash")
BLOCK_DRAFTERS = ("dspark", "dflash")
"""Methods served by the block drafter (`spec_decode/dspark/`): 'dflash' is an alias of 'dspark'."""
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")
MAX_SPECULATIVE_TOKENS = 16
"""Most proposed tokens per step: each one costs a scratch state slot per running sequence."""
MAX_PROMPT_LOOKUP = 64
"""Longest n-gram the prompt lookup matches (longer n-grams almost never recur, and cost search time)."""
DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's default for both n-gram bounds when neither is given."""

_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
_DRAFT_ONLY = ("model", "draft_sample_method", "rejection_sample_method")


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per decoding request before
    each step, and the target model verifies them in that step (outputs are unchanged)."""

    method: str
    """'ngram' (prompt lookup: the tokens that followed an earlier occurrence of the context's last n tokens) or
    'draft_model' (a small model of the same tokenizer drafts them) or 'dspark' (alias 'dflash': a block drafter
    conditioned on the target's hidden states proposes all of them in one forward pass)."""
    num_speculative_tokens: int
    """Most tokens proposed per request and step, 1..16."""
    model: str | None = None
    """draft_model / dspark: the draft checkpoint directory (default: the embedded model's draft or drafter)."""
    prompt_lookup_min: int | None = None
    """ngram only: shortest n-gram matched. vLLM's rule: if only one bound is given the other equals it; with
    neither, both are 5."""
    prompt_lookup_max: int | None = None
    """ngram only: longest n-gram matched (tried first), at most 64."""
    draft_sample_method: str | None = None
    """draft_model / dspark: 'probabilistic' (default: drafts sampled at the request's temperature, verified by
    rejection sampling) or 'greedy' (drafts are the draft model's argmax). Greedy requests always draft greedily."""
    rejection_sample_method: str | None = None
    """draft_model / dspark: how sampled drafts are verified: 'standard' (default: token by token, accept with
    min(1, p/q)) or 'block' (block verification, Sun et al. 2024: the draft block is accepted jointly, never fewer
    tokens in expectation). Both keep the target's distribution exactly."""
    enable_adaptive_verification: bool = True
    """dspark: each step verifies, per request, only the draft positions worth their cost at the current load (from
    the drafter's confidence and step costs measured at start-up), down to none; False: verify every draft."""
    disable_by_batch_size: int | None = None
    """Propose nothing in steps with at least this many running requests (vLLM's `disable_by_batch_size`): at large
    batches a step is compute-bound, and verifying proposals costs more than the tokens it saves. None: never."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(_err("method", f"must be one of {', '.join(repr(m) for m in METHODS)}", self.method))
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 2**31 - 1)
        not_for = _DRAFT_ONLY if self.method == "ngram" else _NGRAM_ONLY
        for name in not_for:
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} does not apply to method {self.method!r}")
        if self.method == "ngram":
            for name in _NGRAM_ONLY:
                if getattr(self, name) is not None:
                    _check_int(name, getattr(self, name), 1, MAX_PROMPT_LOOKUP)
            lo = self.prompt_lookup_min if self.prompt_lookup_min is not None else (
                self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP)
            hi = self.prompt_lookup_max if self.prompt_lookup_max is not None else lo
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise ValueError(_err("model", "must be a checkpoint directory (a non-empty string)", self.model))
            method = self.draft_sample_method or "probabilistic"
            if method not in DRAFT_SAMPLE_METHODS:
                raise ValueError(_err("draft_sample_method", "must be 'greedy' or 'probabilistic'", method))
            object.__setattr__(self, "draft_sample_method", method)
            rejection = self.rejection_sample_method or "standard"
            if rejection not in REJECTION_SAMPLE_METHODS:
                raise ValueError(_err("rejection_sample_method", "must be 'standard' or 'block'", rejection))
            object.__setattr__(self, "rejection_sample_method", rejection)
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ValueError(_err("enable_adaptive_verification", "must be true or false",
                                  self.enable_adaptive_verification))

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Parse a JSON object (text or an already decoded dict), as given to `--speculative-config`.

        Unknown keys, wrong types and bad values raise a one-line ValueError naming the field."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_object(value, "speculative_config")
        check_known_fields(value, [f.name for f in fields(cls)], "speculative_config")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required} is required")
        for name in ("method", "model", "draft_sample_method", "rejection_sample_method"):
            if name in value and value[name] is not None and not isinstance(value[name], str):
                raise ValueError(_err(name, "must be a string", value[name]))
        return cls(**value)


def _err(name: str, rule: str, value: Any) -> str:
    return f"speculative_config.{name} {rule}, got {value!r:.60}"


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(_err(name, f"must be an integer in {lo}..{hi}", value))
