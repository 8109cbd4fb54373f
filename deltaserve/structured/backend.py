"""The structured-output backend interface: a backend compiles a `StructuredOutput` into a per-request `Grammar`.

A grammar writes the allowed next tokens of its request into one row of a token bitmask: ``int32 [R,
ceil(vocab_size / 32)]``, bit ``j`` of word ``w`` set = token ``32 * w + j`` allowed (the layout llguidance and
xgrammar both write). The engine fills one row per constrained request that samples in a step; the sampler sets
every disallowed logit to -inf (`deltaserve.ops.sampling.apply_token_bitmask`).

The backend names and `make_backend` live in `factory.py`: this interface imports no implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, ClassVar

from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the API process validates grammars without loading torch
    import torch


class Grammar(ABC):
    """One request's position in its grammar. Advanced once per sampled token; never re-fed on recompute."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it (the grammar is then unusable)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (CPU int32 ``[R, ceil(V / 32)]``). Once the text is
        complete, only the request's stop token ids are allowed."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constrained text is complete: nothing but a stop token may follow it."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` the grammar accepts in a row from its current state, which stays unchanged
        (proposed tokens of speculative decoding are cut there)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens). RuntimeError if it cannot."""


class StructuredOutputBackend(ABC):
    """Compiles constraints against one tokenizer; thread-safe, so the engine can compile in a thread pool.

    Args:
        tokenizer: the checkpoint's tokenizer (token bytes, special-token names, eos ids).
        vocab_size: width of the model's logits (>= the tokenizer's ids); ids the tokenizer lacks are never
            allowed. Defaults to the tokenizer's vocabulary size.
    """

    name: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
                             "ids: the logits could not cover every token")

    @abstractmethod
    def compile(self, structured: StructuredOutput, stop_token_ids: Collection[int]) -> Grammar:
        """A fresh grammar for one request. `stop_token_ids` are the request's stop tokens: the grammar allows them
        once its text is complete (an empty set falls back to the tokenizer's eos ids). ValueError if the
        constraint is invalid. May take a while for a large schema: call it off the step loop."""

    @abstractmethod
    def validate(self, structured: StructuredOutput) -> None:
        """Raise ValueError, with a message fit for a 400 reply, if `structured` would not compile."""

    def fill_bitmask(self, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
        """Fill ``bitmask[i]`` for ``grammars[i]`` (a backend may do the rows in parallel)."""
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU ``int32 [num_rows, ceil(vocab_size / 32)]`` bitmask with every token allowed."""
    import torch

    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row (for tests and debugging)."""
    import torch

    bits = (bitmask_row.to(torch.int64)[:, None] >> torch.arange(32)) & 1  # [W, 32]
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()


def set_allowed(bitmask: torch.Tensor, row: int, token_ids: Collection[int]) -> None:
    """Make ``bitmask[row]`` allow exactly `token_ids`."""
    import torch

    words = [0] * bitmask.shape[1]
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def vocab_bytes(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[bytes], dict[int, str]]:
    """The bytes of every id below `vocab_size` (b"" for ids the tokenizer lacks, the name for a special token) and
    the special tokens by id (every whole-match token of `Tokenizer.special_tokens`)."""
    special = {i: name for name, i in tokenizer.special_tokens.items()}
    tokens = [
        special[i].encode() if i in special else tokenizer.decode_bytes([i])
        for i in range(tokenizer.vocab_size)
    ]
    tokens += [b""] * (vocab_size - len(tokens))
    return tokens, special
