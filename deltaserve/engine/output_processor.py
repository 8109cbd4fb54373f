"""`OutputProcessor`: from an `EngineClient`'s token stream to what a frontend shows, shared by `LLM` and the server.

It fans a request out into `n` engine sequences (child seeds by `child_seed`), turns each sequence's token ids into
channel deltas through one `SequenceProcessor` (`TextProcessor`: incremental detokenisation and stop strings;
`ChatProcessor`: an output parser plus stop strings on the content channel), ends a sequence early on a stop string
(aborted with FinishReason.STOP), passes logprobs through, and yields one `SequenceUpdate` per engine output.
Latency metrics are the caller's: an optional `RequestMetrics` observer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.engine.protocol import EngineClient
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.outputs import TokenLogprobs
from deltaserve.parsers.types import OutputParser, ParsedDelta
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams, child_seed
from deltaserve.text.detokenizer import IncrementalDetokenizer
from deltaserve.text.stop_strings import StopStringFilter
from deltaserve.text.tokenizer import Tokenizer

T = TypeVar("T")
_END = object()
"""A merged stream's last item."""


class SequenceProcessor(Protocol):
    """Turns one sequence's token ids into channel deltas; reports a stop string that ends it."""

    def push(self, token_ids: Sequence[int]) -> tuple[ParsedDelta, str | None]:
        """Consume new ids; return what can be shown now and the stop string they completed (None if none)."""
        ...

    def finish(self) -> ParsedDelta:
        """The engine ended the sequence (not a stop string): flush whatever was held back."""
        ...


class TextProcessor:
    """Completions: incremental detokenisation with stop strings (everything goes to `content`)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)

    def push(self, token_ids: Sequence[int]) -> tuple[ParsedDelta, str | None]:
        update = self._detok.push(token_ids)
        return _content(update.text_delta), update.stop_string

    def finish(self) -> ParsedDelta:
        return _content(self._detok.finish())


@functools.lru_cache(maxsize=8192)
def _content(text: str) -> ParsedDelta:
    """A content-only delta, shared: deltas are immutable and most are one token's text, which repeats (building
    a frozen dataclass per token costs more than the detokenisation's bookkeeping)."""
    return ParsedDelta(content=text)


class ChatProcessor:
    """Chat: the format's output parser splits channels; stop strings apply to the content channel."""

    def __init__(self, parser: OutputParser, params: SamplingParams) -> None:
        self._parser = parser
        self._stop = StopStringFilter(params.stop, include=params.include_stop_str_in_output)

    def push(self, token_ids: Sequence[int]) -> tuple[ParsedDelta, str | None]:
        return self._filter(self._parser.push(token_ids))

    def finish(self) -> ParsedDelta:
        delta, _ = self._filter(self._parser.finish())
        return dataclasses.replace(delta, content=delta.content + self._stop.flush())

    def _filter(self, delta: ParsedDelta) -> tuple[ParsedDelta, str | None]:
        if self._stop.matched is not None:
            return ParsedDelta(), None
        content, stop = self._stop.push(delta.content)
        return dataclasses.replace(delta, content=content), stop


class SequenceUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine output (or the end) adds to output sequence `index`. A msgspec Struct because one is made
    per sequence per step: it is built several times faster than a frozen dataclass."""

    index: int
    delta: ParsedDelta
    token_ids: list[int]
    """The engine output's new ids (its own list: read, do not change)."""
    logprobs: list[TokenLogprobs | None]
    """Per new token a `TokenLogprobs`, or None where logprobs were not requested."""
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' on the sequence's last update."""
    stop_string: str | None = None
    """The stop string that ended the sequence (its last update), else None."""
    num_cached_tokens: int = 0
    """Prompt tokens the engine served from the prefix cache."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On a sequence's first update, with params.prompt_logprobs: a `TokenLogprobs` per prompt token after the
    first."""
    kv_transfer_params: dict[str, Any] | None = None
    """On the last update of a prefill instance's sequence whose cache was published: what a decode instance needs
    to fetch it."""


class RequestMetrics(Protocol):
    """Latency observer of the output processor (the server's Prometheus metrics); times in seconds."""

    def observe_itl(self, seconds: float) -> None:
        """Time between two consecutive token deliveries of one sequence."""
        ...

    def observe_finished(self, reason: str, *, prompt_tokens: int, generated: int, ttft: float | None,
                         e2e: float) -> None:
        """A sequence ended: its reason, the prompt's tokens (counted on sequence 0 only), its generated tokens,
        arrival to the request's first token (None if none), arrival to this end."""
        ...


@dataclass(slots=True)
class _RequestTiming:
    """Shared by the sequences of one request, for its metrics."""

    arrival: float
    prompt_tokens: int
    first_token_time: float | None = None


@dataclass(slots=True)
class SequenceState:
    """One output sequence of a request: its engine request id, n=1 params and processor."""

    index: int
    request_id: str
    params: SamplingParams
    processor: SequenceProcessor
    timing: _RequestTiming | None = None
    """Set when the processor has metrics."""
    num_tokens: int = 0
    last_token_time: float | None = None


class OutputProcessor:
    """Turns `client` streams into `SequenceUpdate`s (see the module docstring). Stateless between requests: one
    instance serves any number of concurrent requests on the client's event loop."""

    def __init__(self, client: EngineClient, *, eos_token_ids: frozenset[int],
                 metrics: RequestMetrics | None = None) -> None:
        self.client = client
        self.eos_token_ids = eos_token_ids
        """Passed with every request (the model's and the tokenizer's end-of-sequence ids)."""
        self.metrics = metrics

    def sequences(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  make_processor: Callable[[SamplingParams], SequenceProcessor]) -> list[SequenceState]:
        """The `params.n` sequences of a request: ids `request_id` (n=1) or `{request_id}-{j}`, each with n=1
        params and seed `child_seed(params.seed, j)`, and a processor made for those params."""
        timing = None if self.metrics is None else _RequestTiming(time.perf_counter(), len(prompt_ids))
        if params.n == 1:
            return [SequenceState(0, request_id, params, make_processor(params), timing)]
        out = []
        for j in range(params.n):
            child = dataclasses.replace(params, n=1, seed=child_seed(params.seed, j))
            out.append(SequenceState(j, f"{request_id}-{j}", child, make_processor(child), timing))
        return out

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       make_processor: Callable[[SamplingParams], SequenceProcessor], *, priority: int = 0,
                       session_id: str | None = None, kv_transfer_params: dict[str, Any] | None = None,
                       images: tuple[ImageInput, ...] = ()) -> AsyncGenerator[SequenceUpdate, None]:
        """Run the `params.n` sequences of a request; yield their updates as they come, each sequence's last one
        with a reason. The client's errors propagate (the first one ends every sequence); closing the iterator
        early aborts the sequences still running. `session_id`: the client's routing hint (protocol.py);
        `images`: the prompt's preprocessed images."""
        seqs = self.sequences(request_id, prompt_ids, params, make_processor)
        if len(seqs) == 1:
            one = self.stream(seqs[0], prompt_ids, priority=priority, session_id=session_id,
                              kv_transfer_params=kv_transfer_params, images=images)
            async with contextlib.aclosing(one) as updates:
                async for update in updates:
                    yield update
            return
        async with contextlib.aclosing(merge([self.stream(s, prompt_ids, priority=priority, session_id=session_id,
                                                          kv_transfer_params=kv_transfer_params, images=images)
                                              for s in seqs])) as all_:
            async for _, update in all_:
                yield update

    async def stream(self, seq: SequenceState, prompt_ids: list[int], *, priority: int = 0,
                     session_id: str | None = None, kv_transfer_params: dict[str, Any] | None = None,
                     images: tuple[ImageInput, ...] = ()) -> AsyncGenerator[SequenceUpdate, None]:
        """Run one sequence: one update per engine output, until the one with a reason. A stop string aborts the
        engine request with FinishReason.STOP before the update that ends with it is yielded."""
        outputs = self.client.generate(seq.request_id, prompt_ids, seq.params, eos_token_ids=self.eos_token_ids,
                                       priority=priority, session_id=session_id,
                                       kv_transfer_params=kv_transfer_params, images=images)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                update = self._update(seq, out)
                if update.stop_string is not None and out.finish_reason is None:
                    await self.client.abort(seq.request_id, FinishReason.STOP)
                yield update
                if update.finish_reason is not None:
                    return

    def _update(self, seq: SequenceState, out: EngineCoreOutput) -> SequenceUpdate:
        delta, stop_string = seq.processor.push(out.new_token_ids[:1])
        for i, token in enumerate(out.new_token_ids[1:], start=1):  # several tokens (a speculative step)
            if stop_string is not None:  # the text was cut at the stop string: so are the tokens and logprobs
                out = msgspec.structs.replace(out, new_token_ids=out.new_token_ids[:i], logprobs=out.logprobs[:i],
                                              finish_reason=None)  # it ends by the stop string, not a later token
                break
            more, stop_string = seq.processor.push([token])
            delta = _join(delta, more)
        reason: str | None = None if out.finish_reason is None else out.finish_reason.value
        if stop_string is not None and reason is None:
            reason = FinishReason.STOP.value
        if reason is not None and stop_string is None:
            delta = _join(delta, seq.processor.finish())
        seq.num_tokens += len(out.new_token_ids)
        if seq.timing is not None and self.metrics is not None:
            _observe(self.metrics, seq, seq.timing, bool(out.new_token_ids), reason)
        return SequenceUpdate(index=seq.index, delta=delta, token_ids=out.new_token_ids, logprobs=out.logprobs,
                              finish_reason=reason, stop_string=stop_string, num_cached_tokens=out.num_cached_tokens,
                              prompt_logprobs=out.prompt_logprobs, kv_transfer_params=out.kv_transfer_params)


async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave async iterators as their items come, each item with its stream's position (one task per
    stream). The first stream that raises ends the merge with its exception; leaving the merge (or closing it)
    closes every stream."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(position: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((position, item))
            queue.put_nowait((position, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((position, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            position, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _observe(metrics: RequestMetrics, seq: SequenceState, timing: _RequestTiming, has_tokens: bool,
             reason: str | None) -> None:
    now = time.perf_counter()
    if has_tokens:
        if timing.first_token_time is None:
            timing.first_token_time = now
        elif seq.last_token_time is not None:
            metrics.observe_itl(now - seq.last_token_time)
        seq.last_token_time = now
    if reason is not None:
        ttft = None if timing.first_token_time is None else timing.first_token_time - timing.arrival
        metrics.observe_finished(reason, prompt_tokens=timing.prompt_tokens if seq.index == 0 else 0,
                                 generated=seq.num_tokens, ttft=ttft, e2e=now - timing.arrival)


def _join(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    if not b:
        return a
    return ParsedDelta(reasoning=a.reasoning + b.reasoning, content=a.content + b.content,
                       tool_calls=a.tool_calls + b.tool_calls)
