"""The default structured-output backend: llguidance (JSON schema, regex and Lark grammars; lazy, fast to compile).

llguidance sees our `Tokenizer` through a `TokenizerWrapper`-shaped object: the bytes of every id, the ids of the
special tokens (spelled by name, so a Lark grammar can write `<|im_end|>`), and an encode function. Its eos set is a
property of the `LLTokenizer`, so one is built per distinct stop-token set (cached): a grammar whose text is
complete then allows exactly the request's stop tokens.

Masks are written straight into the bitmask's memory (what `llguidance.torch` wraps; that module is not imported
because its `torch.compile` decorator pulls in inductor, seconds of import).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import llguidance

from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured.backend import Grammar, StructuredOutputBackend, vocab_bytes
from deltaserve.structured.schema_check import check_satisfiable
from deltaserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the API process validates grammars without loading torch
    import torch
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only, absent at run time

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Fixed-whitespace JSON with Python's `json.dumps` separators (", " and ": ", no other whitespace): a weak model
cannot loop on whitespace. A schema may override it with an "x-guidance" object, e.g.
{"x-guidance": {"whitespace_flexible": true}}."""
MAX_CACHED_TOKENIZERS = 8  # one LLTokenizer per distinct stop-token set

logger = logging.getLogger(__name__)


class _TokenizerView:
    """What `llguidance.TokenizerWrapper` reads: eos/bos ids, token bytes, special ids, and `__call__` to encode."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special_ids: list[int], eos_token_id: int):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), allow_special=False)


class LLGuidanceGrammar(Grammar):
    """One request's `llguidance.LLMatcher`."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self._error_logged = False

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask)
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self.report_error()

    def report_error(self) -> None:
        """A matcher that hit a resource limit allows only the stop tokens from then on: say why, once."""
        if not self._error_logged and self.matcher.is_error():
            self._error_logged = True
            logger.warning("grammar stopped with an error; only stop tokens are allowed: %s",
                           self.matcher.get_error().splitlines()[0])

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def rollback(self, num_tokens: int) -> None:
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.matcher.get_error()}")


class LLGuidanceBackend(StructuredOutputBackend):
    """Compiles `StructuredOutput`s with llguidance. See `StructuredOutputBackend`."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        super().__init__(tokenizer, vocab_size)
        self._tokens, special = vocab_bytes(tokenizer, self.vocab_size)
        self._special_ids = sorted(special)
        self._default_eos = tuple(sorted(tokenizer.eos_token_ids))
        if not self._default_eos:
            raise ValueError("structured output needs an end-of-sequence token, and the tokenizer names none")
        self._lock = threading.Lock()
        self._tokenizers: OrderedDict[tuple[int, ...], llguidance.LLTokenizer] = OrderedDict()
        self._executor = llguidance.LLExecutor()

    def compile(self, structured: StructuredOutput, stop_token_ids: Collection[int]) -> Grammar:
        lltok = self.lltokenizer(stop_token_ids)
        matcher = llguidance.LLMatcher(lltok, grammar_text(structured), log_level=0)
        if matcher.is_error():
            raise ValueError(_message(structured, matcher.get_error()))
        return LLGuidanceGrammar(matcher)

    def validate(self, structured: StructuredOutput) -> None:
        if structured.kind == "json_schema":  # compiles, yet fails only after generation started (schema_check.py)
            _check_satisfiable(structured)
        text, lltok = grammar_text(structured), self.lltokenizer(())
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, lltok)
        if is_error:
            raise ValueError(_message(structured, messages[0] if messages else "invalid"))
        # A grammar can compile and still allow no first token (a schema that is only `{"$ref": "#"}`): the
        # request would end empty with a 200. The first mask says so, cheaply.
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(_message(structured, matcher.get_error().splitlines()[0]))

    def fill_bitmask(self, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
        own = [g for g in grammars if isinstance(g, LLGuidanceGrammar)]
        if len(own) == len(grammars):
            _check_bitmask(bitmask)
            rows = [(g.matcher, row) for row, g in enumerate(own)]
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
            for g in own:
                g.report_error()
        else:
            super().fill_bitmask(grammars, bitmask)

    def lltokenizer(self, stop_token_ids: Collection[int]) -> llguidance.LLTokenizer:
        """The `LLTokenizer` whose eos set is `stop_token_ids` (or the tokenizer's eos ids when empty); cached."""
        eos = tuple(sorted(set(stop_token_ids))) or self._default_eos
        bad = [t for t in eos if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        with self._lock:
            if eos in self._tokenizers:
                self._tokenizers.move_to_end(eos)
                return self._tokenizers[eos]
            view = _TokenizerView(self.tokenizer, self._tokens, self._special_ids, eos[0])
            lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size,
                                           eos_token=list(eos))
            self._tokenizers[eos] = lltok
            if len(self._tokenizers) > MAX_CACHED_TOKENIZERS:
                self._tokenizers.popitem(last=False)
            return lltok


def _check_bitmask(bitmask: torch.Tensor) -> None:
    """llguidance writes through a raw pointer: the target must be a contiguous CPU int32 [R, W] tensor."""
    import torch

    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.ndim != 2 or not bitmask.is_contiguous():
        raise ValueError(f"the bitmask must be a contiguous CPU int32 [R, W] tensor, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint. ValueError for a json_schema that is not a JSON object."""
    if structured.kind == "json_schema":
        try:
            schema = json.loads(structured.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"structured json_schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_DEFAULTS)
    if structured.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    return llguidance.LLMatcher.grammar_from_lark(structured.spec)


def _check_satisfiable(structured: StructuredOutput) -> None:
    try:
        check_satisfiable(structured.spec)
    except ValueError as exc:
        raise ValueError(_message(structured, str(exc))) from None


def _message(structured: StructuredOutput, detail: str) -> str:
    return f"invalid structured {structured.kind}: {detail.strip()}"
