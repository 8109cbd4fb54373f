"""`Frontend`: what every route shares between parsing its request body and writing its response.

It owns the engine client, the tokenizer and chat format, the limits and the metrics. `generate` runs a request
through the shared `OutputProcessor` (engine/output_processor.py: `n` fan-out, one `SequenceProcessor` per
sequence, stop strings), with the server's latency metrics as its observer, and turns engine errors into API
errors. Closing the generator early (client gone) aborts every sequence still running in the engine.

Rendering and tokenizing a prompt can take seconds for a body of megabytes, so the routes do it in `offload`'s small
thread pool, never on the event loop (tiktoken and `tokenizers`' batch encode release the GIL; pure-Python rendering
yields it every few milliseconds). Before that, `check_text_length` refuses text that could not fit the context
whatever its tokenization, at the cost of counting characters; text that passes it is rendered with `render_limit`,
so that a prompt past the context stops being tokenized there (`prompt_too_long`) instead of becoming millions of
ids whose list work holds the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from deltaserve.chat.format import ChatFormat
from deltaserve.chat.messages import ToolSpec
from deltaserve.config import ServerConfig
from deltaserve.engine.output_processor import ChatProcessor, OutputProcessor, SequenceProcessor, SequenceUpdate
from deltaserve.engine.protocol import EngineClient, EngineDeadError, EngineRequestError
from deltaserve.entrypoints.server.errors import ApiError, bad_request
from deltaserve.entrypoints.server.images import ImageSupport
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.entrypoints.server.stream_buffer import bounded_stream
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.sampling_params import SamplingParams, StructuredOutput
from deltaserve.structured.backend import StructuredOutputBackend
from deltaserve.structured.schema_check import check_satisfiable
from deltaserve.text.tokenizer import Tokenizer, TokenLimitExceeded

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
RENDER_THREADS = 4
"""Prompts rendered and tokenized at once; more wait for a thread (each holds its body's text and token ids)."""


def chat_processors(frontend: Frontend, *, thinking: bool, tools: bool) -> Callable[[SamplingParams], ChatProcessor]:
    """Per-sequence factory for chat routes: the chat format's output parser plus stop strings."""
    def make(params: SamplingParams) -> ChatProcessor:
        parser = frontend.chat_format.make_parser(frontend.tokenizer, thinking=thinking, tools=tools)
        return ChatProcessor(parser, params)
    return make


class Frontend:
    """Shared state of the API process: engine client, tokenizer, chat format, limits and metrics."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, chat_format: ChatFormat,
                 config: ServerConfig, metrics: ServerMetrics, model_name: str, max_num_seqs: int,
                 structured_backend: StructuredOutputBackend, model_root: str = "",
                 priority_scheduling: bool = False) -> None:
        self.client = client
        self.model_root = model_root
        """The checkpoint directory (vLLM's `root` in /v1/models: a client on this host can load its tokenizer)."""
        self.priority_scheduling = priority_scheduling
        """The engine orders its queue by request priority (`--policy priority`)."""
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.config = config
        self.metrics = metrics
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(client.info.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self.structured_backend = structured_backend
        self.output = OutputProcessor(client, eos_token_ids=self.eos_token_ids, metrics=metrics)
        self.max_token_bytes = max((len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size)),
                                   default=1)
        """UTF-8 bytes of the longest token: a text of C characters has at least C / this many tokens."""
        self._render_pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="render")
        self.images = ImageSupport.from_model(model_root, config.media)
        """How the model takes images (None: it has no vision tower, and image content is a 400)."""

    async def offload(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` in the render thread pool (prompt rendering, tokenizing, grammar validation), so
        that a large body does not stall every other request's stream."""
        return await asyncio.get_running_loop().run_in_executor(self._render_pool,
                                                                functools.partial(fn, *args, **kwargs))

    def stream_error(self, exc: Exception) -> ApiError:
        """What a stream reports (as its last event) for `exc`, raised after its 200 went out: the `ApiError` itself,
        else a logged internal error."""
        if isinstance(exc, ApiError):
            return exc
        logger.error("unhandled error in a stream", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}")

    def check_text_length(self, num_chars: int, *, param: str) -> None:
        """400 before tokenizing when `num_chars` characters of prompt text cannot fit `max_model_len` whatever
        their tokenization. Sound for a byte-level BPE, where the tokens of a text spell its UTF-8 bytes (at least
        one per character) and none spells more than `max_token_bytes`: such a text has at least
        num_chars / max_token_bytes tokens. Text that passes is tokenized and checked exactly."""
        limit = self.max_model_len * self.max_token_bytes
        if num_chars > limit:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"prompt has {num_chars} characters, more than {self.max_model_len} tokens can hold "
                              f"(at most {limit} characters: no token of this model is longer than "
                              f"{self.max_token_bytes} bytes). Please reduce the length of the prompt.",
                              param=param, code="context_length_exceeded")

    def render_limit(self, truncate_prompt_tokens: int | None) -> int | None:
        """`max_tokens` for rendering or encoding a generation prompt: past max_model_len a prompt is refused
        whatever its length, so tokenizing stops there (`TokenLimitExceeded`, answered by `prompt_too_long`);
        None with truncate_prompt_tokens, which keeps the tail of the whole prompt."""
        return self.max_model_len if truncate_prompt_tokens is None else None

    def prompt_too_long(self, *, param: str) -> ApiError:
        """The 400 for a prompt whose rendering stopped past max_model_len (its exact length is not known)."""
        return bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"prompt has more than {self.max_model_len} tokens. Please reduce the length of the "
                           f"prompt.", param=param, code="context_length_exceeded")

    def encode_prompt(self, text: str, *, truncate_prompt_tokens: int | None, param: str = "prompt") -> list[int]:
        """Ids of a text prompt (special tokens allowed, as vLLM encodes a completion prompt); `prompt_too_long`
        as soon as it is known to have more than `render_limit` tokens."""
        try:
            return self.tokenizer.encode(text, max_tokens=self.render_limit(truncate_prompt_tokens))
        except TokenLimitExceeded:
            raise self.prompt_too_long(param=param) from None

    def stream(self, request_id: str, updates: AsyncGenerator[SequenceUpdate, None]
               ) -> AsyncGenerator[SequenceUpdate, None]:
        """A streaming response's updates, the request aborted once its client leaves more than
        `max_unread_stream_tokens` generated tokens unread (stream_buffer.py)."""
        return bounded_stream(updates, max_unread_tokens=self.config.max_unread_stream_tokens,
                              request_id=request_id)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, name: str | None, *, param: str = "model") -> None:
        """404 unless `name` is the served model name (a missing name means the served model)."""
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist. Available: `{self.model_name}`.", param=param,
                           code="model_not_found")

    def validate_structured(self, structured: StructuredOutput, *, param: str) -> None:
        """400 for a JSON schema, regex or grammar the backend cannot compile (checked before queueing)."""
        try:
            self.structured_backend.validate(structured)
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="invalid_structured_output") from exc

    def validate_tool_grammar(self, tools: Sequence[ToolSpec], grammar: StructuredOutput, *, param: str,
                              name: str | None = None) -> None:
        """400 for a forced tool call whose grammar cannot be compiled, naming the tool whose parameter schema is
        at fault (`name`: the one forced function, else every tool is in the grammar). Checked before queueing,
        so that a streaming request gets it as an HTTP error. A parameter schema that admits no value (which the
        grammar compiles, to fail only mid-generation) is refused too (structured/schema_check.py)."""
        for i, tool in enumerate(tools):
            if name is None or tool.name == name:
                try:
                    check_satisfiable(json.dumps(tool.parameters))
                except ValueError as exc:
                    raise bad_request(f"invalid parameters of tool {tool.name!r}: {exc}", param=f"{param}[{i}]",
                                      code="invalid_structured_output") from exc
        try:
            self.structured_backend.validate(grammar)
        except ValueError as exc:
            for i, tool in enumerate(tools):
                if name is None or tool.name == name:
                    self.validate_structured(StructuredOutput("json_schema", json.dumps(tool.parameters)),
                                             param=f"{param}[{i}]")
            raise bad_request(str(exc), param=param, code="invalid_structured_output") from exc

    def check_capacity(self, n: int) -> None:
        """503 with Retry-After when the engine's queue is full, 503 when the engine is gone."""
        if not self.client.is_alive:
            raise ApiError(503, "the engine process is not running", code="engine_dead")
        if n > self.max_num_seqs + self.config.max_queued_requests:  # would never be admitted: retrying is no use
            raise bad_request(f"the request asks for {n} sequences; the server holds at most "
                              f"{self.max_num_seqs + self.config.max_queued_requests} running and queued", param="n")
        if self.client.num_unfinished + n > self.max_num_seqs + self.config.max_queued_requests:
            raise ApiError(503, "the server is overloaded: too many queued requests; retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, *, param: str = "max_tokens",
                           prompt_param: str = "messages") -> int:
        """vLLM's rule: default to the rest of the context (here: and of the KV cache); 400 when the prompt or
        prompt + requested is too long for either."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"prompt has {prompt_len} tokens (room for at least one generated token is needed).",
                              param=prompt_param,
                              code="context_length_exceeded")
        # The engine refuses a request whose KV could never fit its cache (its last token's KV is never cached);
        # checked here too, so that a streaming request gets the 400 before its event stream starts.
        cache_tokens = self.client.info.num_blocks * self.client.info.block_size
        if requested is None:  # the default stops where the context or the cache is full
            if prompt_len > cache_tokens:
                raise bad_request(f"the prompt has {prompt_len} tokens but the server's KV cache holds "
                                  f"{cache_tokens}", param=prompt_param, code="context_length_exceeded")
            return min(room, cache_tokens + 1 - prompt_len)
        if requested < 1:
            raise bad_request(f"{param} must be at least 1, got {requested}", param=param)
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                              f"for the completion). Please reduce the prompt or {param}.", param=param,
                              code="context_length_exceeded")
        if prompt_len + requested - 1 > cache_tokens:
            raise bad_request(f"the request needs up to {prompt_len + requested - 1} tokens of KV cache but the "
                              f"server's cache holds {cache_tokens}: lower {param} or the prompt", param=param,
                              code="context_length_exceeded")
        return requested

    def check_prompt_ids(self, ids: Sequence[int], *, param: str = "prompt") -> list[int]:
        vocab = self.client.info.vocab_size
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param=param)
        return list(ids)

    def bad_words_token_ids(self, words: Sequence[str] | None) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad_words: each word alone, and after a space when that gives other tokens of the
        same count (a word inside the text); 400 for an empty word."""
        out: list[tuple[int, ...]] = []
        for word in words or ():
            alone = tuple(self.tokenizer.encode(word.lstrip(), allow_special=False))
            if not alone:
                raise bad_request(f"bad_words entries must contain text, got {word!r:.40}", param="bad_words")
            out.append(alone)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), allow_special=False))
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(out)

    def truncation(self, truncate_prompt_tokens: int) -> int:
        """How many trailing prompt tokens vLLM's truncate_prompt_tokens keeps (-1: max_model_len; 0 is a 400)."""
        if truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be >= 1 (or -1 for max_model_len)",
                              param="truncate_prompt_tokens")
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def check_priority(self, priority: int) -> int:
        """vLLM's rule: a priority other than 0 needs a server started with priority scheduling (400 otherwise);
        lower values are served first."""
        if priority != 0 and not self.priority_scheduling:
            raise bad_request("priority needs a server started with --policy priority", param="priority")
        if not -(2**63) <= priority < 2**63:
            raise bad_request(f"priority must be a 64-bit integer, got {priority}", param="priority")
        return priority

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       make_processor: Callable[[SamplingParams], SequenceProcessor], priority: int = 0,
                       session_id: str | None = None, kv_transfer_params: dict[str, Any] | None = None,
                       images: tuple[ImageInput, ...] = ()) -> AsyncGenerator[SequenceUpdate, None]:
        """Run `params.n` sequences through the output processor; yield their updates as they come, each
        sequence's last one with a reason. `session_id` (the `X-Session-ID` header, OpenAI's `user`, Anthropic's
        `metadata.user_id`) keeps a conversation on one data-parallel replica. `kv_transfer_params`: prefill/decode
        disaggregation (`EngineCore.add_request`). `images`: the prompt's images (`RenderedPrompt.images`).

        Raises ApiError (400 for a request the engine rejects or fails, 503 when the engine died). Closing the
        iterator early aborts the sequences still running.
        """
        updates = self.output.generate(request_id, prompt_ids, params, make_processor, priority=priority,
                                       session_id=session_id, kv_transfer_params=kv_transfer_params, images=images)
        async with contextlib.aclosing(updates):
            try:
                async for update in updates:
                    yield update
            except EngineRequestError as exc:
                raise bad_request(str(exc)) from exc
            except EngineDeadError as exc:
                if self.client.is_alive:  # data parallelism: this request's replica died, the others serve
                    raise ApiError(503, "the engine replica serving this request died; retry it",
                                   code="engine_dead", headers={"Retry-After": "1"}) from exc
                raise ApiError(503, "the engine process died; the server cannot serve requests",
                               code="engine_dead") from exc
