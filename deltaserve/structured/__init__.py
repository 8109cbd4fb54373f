"""Structured output: grammar-constrained sampling. A backend (llguidance by default, xgrammar optionally) compiles
a `StructuredOutput` into a per-request `Grammar` that fills a token bitmask; the manager compiles off the step loop.

The HTTP server validates a constraint before queuing it: ``make_backend(name, tokenizer).validate(structured)``.
"""

from deltaserve.structured import backend as _backend
from deltaserve.structured.backend import (
    Grammar,
    StructuredOutputBackend,
    allocate_bitmask,
    allowed_token_ids,
)
from deltaserve.structured.factory import BACKENDS, check_backend, make_backend

# Transitional: `make_backend` moved from backend.py to factory.py. entrypoints/server/launch.py still imports it
# from backend.py; this keeps that working (every import of the submodule runs this package first) without
# backend.py importing the factory, which imports backend.py. Remove once launch.py imports it from factory.py.
_backend.make_backend = make_backend  # type: ignore[attr-defined]  # the old name is deliberately not declared

__all__ = [
    "BACKENDS",
    "Grammar",
    "StructuredOutputBackend",
    "allocate_bitmask",
    "allowed_token_ids",
    "check_backend",
    "make_backend",
]
