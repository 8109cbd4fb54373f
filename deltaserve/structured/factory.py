"""Backend name -> `StructuredOutputBackend`: the one module that knows the implementations, so the interface
(`backend.py`) imports none of them."""

from __future__ import annotations

import importlib.util

from deltaserve.structured.backend import StructuredOutputBackend
from deltaserve.structured.llguidance_backend import LLGuidanceBackend
from deltaserve.text.tokenizer import Tokenizer

BACKENDS: tuple[str, ...] = ("llguidance", "xgrammar")


def check_backend(name: str) -> None:
    """ValueError for an unknown backend name, or one whose library is not installed."""
    if name not in BACKENDS:
        raise ValueError(f"structured_output_backend={name!r} is not supported (supported: {', '.join(BACKENDS)})")
    if importlib.util.find_spec(name) is None:
        raise ValueError(f"structured_output_backend={name!r} needs the {name!r} package, which is not installed "
                         f"(pip install {name}), or use the default 'llguidance'")


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int | None = None) -> StructuredOutputBackend:
    """The backend called `name` ("llguidance" or "xgrammar"). ValueError if unknown or missing."""
    check_backend(name)
    if name == "xgrammar":
        # Imported here: the module loads torch, which the API process (it validates with llguidance) never needs.
        from deltaserve.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size)
    return LLGuidanceBackend(tokenizer, vocab_size)
