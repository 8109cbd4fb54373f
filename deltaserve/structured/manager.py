"""`StructuredOutputManager`: compiles grammars off the step loop and builds each step's token bitmask.

A request with `params.structured` waits here, not in the scheduler, while a thread pool compiles its grammar; the
engine collects it with `take_finished()` at the start of a step (compiled: with its grammar, then scheduled;
failed: finished with an error). Compilation drops the GIL in llguidance, so decoding requests keep stepping.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deltaserve.request import Request
from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured.backend import Grammar, StructuredOutputBackend, allocate_bitmask
from deltaserve.structured.factory import check_backend, make_backend
from deltaserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NUM_COMPILE_THREADS = 2


class StructuredOutputManager:
    """Owns the backend (built on first use, in a compile thread), the compile pool and the compiling requests.

    Args:
        backend_name: "llguidance" or "xgrammar"; ValueError here if unknown or not installed.
        load_tokenizer: returns the checkpoint's tokenizer; called once, in a compile thread, when the first
            constrained request arrives (an engine that never sees one pays nothing).
        vocab_size: width of the model's logits, i.e. of the bitmask.
    """

    def __init__(self, backend_name: str, load_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        check_backend(backend_name)
        self.backend_name, self.vocab_size = backend_name, vocab_size
        self._load_tokenizer = load_tokenizer
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, tuple[Request, Future[Grammar]]] = {}

    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first call (loads the tokenizer and its token table: keep it off the step loop)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = make_backend(self.backend_name, self._load_tokenizer(), self.vocab_size)
            return self._backend

    # -- compiling requests --------------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling `request.params.structured`; the request waits here until `take_finished` returns it."""
        structured = request.params.structured
        if structured is None:
            raise ValueError(f"request {request.request_id!r} has no structured output to compile")
        if request.request_id in self._pending:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="deltaserve-grammar")
        future = self._pool.submit(self._compile, structured, request.stop_token_ids)
        self._pending[request.request_id] = (request, future)

    def _compile(self, structured: StructuredOutput, stop_token_ids: frozenset[int]) -> Grammar:
        return self.backend().compile(structured, stop_token_ids)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is still compiling (or compiled but not yet taken)."""
        return len(self._pending)

    def cancel(self, request_id: str) -> Request | None:
        """Drop a compiling request (abort); its compile result is discarded. None if it is not here."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def wait(self, timeout: float, *, every: bool = False) -> None:
        """Block until some compile (`every`: every compile) finishes or `timeout` seconds pass."""
        if self._pending:
            futures = [f for _, f in self._pending.values()]
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.ALL_COMPLETED if every
                                    else concurrent.futures.FIRST_COMPLETED)

    def take_finished(self) -> tuple[list[tuple[Request, Grammar]], list[tuple[Request, str]]]:
        """Requests whose compile ended, in submission order: the compiled ones with their grammar and the failed
        ones with the error message."""
        compiled: list[tuple[Request, Grammar]] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                compiled.append((request, future.result()))
            except Exception as e:  # a bad spec (ValueError) or a backend failure: finish this request only
                message = str(e) if isinstance(e, ValueError) else f"structured output failed: {type(e).__name__}: {e}"
                logger.warning("request %s: %s", request_id, message)
                failed.append((request, message))
        return compiled, failed

    # -- each step -----------------------------------------------------------------------------------------------

    def bitmask(self, grammars: Sequence[Grammar]) -> torch.Tensor:
        """CPU ``int32 [len(grammars), ceil(vocab_size / 32)]``: row i allows the next tokens of ``grammars[i]``."""
        bitmask = allocate_bitmask(len(grammars), self.vocab_size)
        self.backend().fill_bitmask(grammars, bitmask)
        return bitmask

    def bitmask_along(self, proposals: Sequence[tuple[Grammar, Sequence[int]]]) -> torch.Tensor:
        """CPU ``int32 [sum(1 + len(tokens)), ceil(vocab_size / 32)]``: for each (grammar, proposed tokens), in
        order, the tokens allowed at each position of a speculative verification: now, then after each proposal
        (which the grammar must accept; it is rolled back afterwards)."""
        bitmask = allocate_bitmask(sum(1 + len(tokens) for _, tokens in proposals), self.vocab_size)
        row = 0
        for grammar, tokens in proposals:
            grammar.fill_bitmask(bitmask, row)
            for token in tokens:
                if not grammar.accept_token(token):
                    raise RuntimeError(f"the grammar rejected proposed token {token} it had validated")
                row += 1
                grammar.fill_bitmask(bitmask, row)
            if tokens:
                grammar.rollback(len(tokens))
            row += 1
        return bitmask

    def shutdown(self) -> None:
        """Stop the compile threads (pending compiles are cancelled or left to finish unobserved)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
