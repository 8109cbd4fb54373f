"""`SamplingParams`: per-request decoding settings, with vLLM's names and defaults."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

INT64_MAX = 2**63 - 1
"""Largest integer a field may hold: every one travels to the engine process and into int64 tensors."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily."""

StructuredKind = Literal["json_schema", "json_object", "regex", "lark"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text, enforced by a token bitmask in the sampler (`deltaserve.structured`)."""

    kind: StructuredKind
    """json_schema (spec: the schema as JSON text), json_object (any JSON object; spec ignored), regex (spec: the
    pattern) or lark (spec: a llguidance Lark grammar, may name special tokens)."""
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured.kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured.spec must be a string, got {type(self.spec).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError naming the field."""

    n: int = 1
    """Independent output sequences for the prompt."""
    max_tokens: int = 16
    """Most tokens to generate per output sequence."""
    min_tokens: int = 0
    """Stop tokens and stop strings are ignored (stop tokens masked) until this many tokens exist."""
    temperature: float = 1.0
    """0 means greedy (argmax); so does anything below 1e-5, where logits / temperature would overflow (as vLLM)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all (so does k >= the vocabulary size)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (positive logits divided, negative multiplied)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated."""
    seed: int | None = None
    """Seed of this request's own generator: the same tokens whatever else is in the batch."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Strings that end generation; the text is cut before the stop string."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end generation (the stop token is kept in the output ids)."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence tokens."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and this many most likely alternatives (0: sampled only)."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token after the first (given the tokens before it) and this many
    most likely alternatives. Such a request is not served from the prefix cache (its prompt must be computed)."""
    skip_special_tokens: bool = True
    """Drop special tokens from the output text."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex or a grammar."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias) pairs added to the logits before penalties and sampling (OpenAI's logit_bias: in practice
    -100 bans a token and 100 forces it). A dict {token id: bias} is accepted."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled (vLLM's allowed_token_ids); None allows all."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    """Token sequences never completed (vLLM's bad_words, tokenized): the last token of a sequence is banned when
    the output ends with the rest of it (a one-token sequence is always banned)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        # Duplicates only cost (a 5 MB list of one id once slowed every step): keep each id once, in order.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        self._check_floats()
        _check_int("top_k", self.top_k, -1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
                if getattr(self, name) > 20:
                    raise ValueError(f"{name} must be <= 20, got {getattr(self, name)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative 64-bit integers, got {self.stop_token_ids!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        self._check_token_lists()

    def _check_token_lists(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        if not isinstance(bias, (list, tuple, type({}.items()))):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r:.60}")
        pairs: list[tuple[int, float]] = []
        for pair in bias:
            token, value = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if not _is_token_id(token):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r:.40}")
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r:.40}")
            pairs.append((token, float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(dict(pairs).items())))  # a repeated id: the last bias
        words = self.bad_words_token_ids
        if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, (list, tuple)) and w and all(_is_token_id(t) for t in w) for w in words):
            raise ValueError(f"bad_words_token_ids must be non-empty token id sequences, got {words!r:.60}")
        object.__setattr__(self, "bad_words_token_ids", tuple(dict.fromkeys(tuple(w) for w in words)))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_token_id(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r:.60}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))

    def _check_floats(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not _finite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of output sequence `index` of a request with `n` > 1: `seed + index`, wrapped past 2**64 - 1."""
    if seed is None:
        return None
    return seed + index - 2**64 if seed + index >= 2**64 else seed + index


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


def _check_int(name: str, value: object, minimum: int) -> None:
    # Every integer must fit int64: they travel to the engine process and into int64 tensors.
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= INT64_MAX:
        raise ValueError(f"{name} must be an integer in [{minimum}, 2**63 - 1], got {value!r}")
