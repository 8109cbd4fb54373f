"""Structured output: grammar-constrained sampling. A backend (llguidance by default, xgrammar optionally) compiles
a `StructuredOutput` into a per-request `Grammar` that fills a token bitmask; the manager compiles off the step loop.

The HTTP server validates a constraint before queuing it: ``make_backend(name, tokenizer).validate(structured)``.
"""

from deltaserve.structured.backend import (
    BACKENDS,
    Grammar,
    StructuredOutputBackend,
    allocate_bitmask,
    allowed_token_ids,
    check_backend,
    make_backend,
)

__all__ = [
    "BACKENDS",
    "Grammar",
    "StructuredOutputBackend",
    "allocate_bitmask",
    "allowed_token_ids",
    "check_backend",
    "make_backend",
]
