"""The optional xgrammar backend (JSON schema, any JSON object, regex; no Lark). `xgrammar` is imported lazily and
is not a dependency: it pulls a CUDA build of torch, so install it only where that is wanted.

The vocabulary is handed over as raw bytes (`VocabType.RAW`), special tokens as empty strings so that no text rule
can produce them; each request's stop tokens are the matcher's stop tokens.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection, Sequence
from typing import Any

import torch

from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured.backend import Grammar, StructuredOutputBackend, set_allowed, vocab_bytes
from deltaserve.structured.schema_check import check_satisfiable
from deltaserve.text.tokenizer import Tokenizer

MAX_ROLLBACK_TOKENS = 16
"""Tokens a matcher can undo (speculative decoding rejects at most this many per step)."""


def _import_xgrammar() -> Any:
    try:
        return importlib.import_module("xgrammar")
    except ImportError as e:
        raise ValueError("structured_output_backend='xgrammar' needs the 'xgrammar' package, which is not "
                         f"installed ({e}); use the default 'llguidance'") from None


class XGrammarGrammar(Grammar):
    """One request's `xgrammar.GrammarMatcher`. Once it has taken a stop token it allows only stop tokens."""

    def __init__(self, matcher: Any, stop_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return token_id in self.stop_token_ids
        return bool(self.matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            set_allowed(bitmask, row, self.stop_token_ids)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        accepted = 0  # xgrammar's accept_token leaves the state unchanged when it refuses a token
        for token in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XGrammarBackend(StructuredOutputBackend):
    """Compiles `StructuredOutput`s with xgrammar. See `StructuredOutputBackend`."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        super().__init__(tokenizer, vocab_size)
        self._xgr = xgr = _import_xgrammar()
        tokens, special = vocab_bytes(tokenizer, self.vocab_size)
        for i in special:
            tokens[i] = b""
        self._default_stops = tuple(sorted(tokenizer.eos_token_ids))
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=list(self._default_stops) or None, add_prefix_space=False)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    def compile(self, structured: StructuredOutput, stop_token_ids: Collection[int]) -> Grammar:
        stops = tuple(sorted(set(stop_token_ids))) or self._default_stops
        try:
            compiled = self._compile(structured)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (or its own error types) for a bad spec
            raise ValueError(f"invalid structured {structured.kind}: {e}") from None
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stops) or None,
                                           max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        return XGrammarGrammar(matcher, stops)

    def validate(self, structured: StructuredOutput) -> None:
        xgr = self._xgr
        try:
            if structured.kind == "json_schema":
                check_satisfiable(structured.spec)  # compiles, yet fails only once generating (schema_check.py)
                xgr.Grammar.from_json_schema(_schema_text(structured.spec))
            elif structured.kind == "regex":
                xgr.Grammar.from_regex(structured.spec)
            elif structured.kind == "lark":
                raise ValueError(_no_lark())
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"invalid structured {structured.kind}: {e}") from None

    def _compile(self, structured: StructuredOutput) -> Any:
        if structured.kind == "json_schema":
            return self._compiler.compile_json_schema(_schema_text(structured.spec), any_whitespace=False)
        if structured.kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        if structured.kind == "regex":
            return self._compiler.compile_regex(structured.spec)
        raise ValueError(_no_lark())


def _schema_text(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured json_schema must be a JSON object, got {type(schema).__name__}")
    return spec


def _no_lark() -> str:
    return "structured lark grammars need the 'llguidance' structured_output_backend (xgrammar has no Lark)"
