"""`LLM`: the offline Python API (vLLM-style): `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

`generate` runs on the same seams as the HTTP server: an `InprocEngineClient` (the engine in this process, stepped
inline on a private event loop) and the shared `OutputProcessor` (fan-out of n, detokenization, stop strings,
logprobs); this module only checks the arguments and assembles `RequestOutput`s from the `SequenceUpdate`s.

With `data_parallel_size=N` (N > 1) the engines are N engine processes behind the router of the HTTP server
(`DPEngineClient`, engine/dp_client.py) instead of one in-process `EngineCore`; `generate` batches and routes the
same way, and `shutdown()` (or garbage collection, or the interpreter's exit) stops the processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypedDict, TypeVar

from deltaserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from deltaserve.default_model import default_model_dir
from deltaserve.engine.dp_client import DPEngineClient
from deltaserve.engine.engine_core import EngineCore
from deltaserve.engine.inproc_client import InprocEngineClient
from deltaserve.engine.messages import EngineInfo
from deltaserve.engine.output_processor import OutputProcessor, SequenceState, TextProcessor
from deltaserve.engine.protocol import EngineRequestError
from deltaserve.multimodal import ImageProcessingConfig
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.multimodal.prompt_images import ImageLike, place_images
from deltaserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams
from deltaserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)



class MultiModalPrompt(TypedDict, total=False):
    """vLLM's prompt dict: text or token ids, and `multi_modal_data={"image": image or [images]}` (PIL images,
    uint8 RGB arrays or image file bytes), one `<|media_pad|>` in the prompt per image (widened to its tokens)."""

    prompt: str
    prompt_token_ids: list[int]
    multi_modal_data: dict[str, ImageLike | list[ImageLike]]


Prompt = str | Sequence[int] | MultiModalPrompt
T = TypeVar("T")


class LLM:
    """Generate from a Kimi Linear checkpoint directory with the continuous-batching engine.

    Args:
        model: checkpoint directory (config.json, safetensors weights, tokenizer files); none loads the embedded
            default model (`deltaserve.default_model`).
        dtype: "float32" or "bfloat16" (router, gates and KDA state stay fp32).
        max_model_len: cap on prompt + output tokens (defaults to the model's own limit).
        seed: seed of the generator shared by unseeded sampling requests.
        structured_output_backend: "llguidance" (default) or "xgrammar", for `SamplingParams.structured`.
        num_threads: torch threads of the engine (`--num-threads`; default: sized from the CPU affinity).
        enforce_eager: never capture CUDA graphs nor compile the dspark drafter (`--enforce-eager`).
        cuda_graph_sizes: decode batch sizes captured as CUDA graphs on a GPU (`--cuda-graph-sizes`; default: 1, 2,
            4 and every multiple of 8 up to max_num_seqs, at most 512).
        max_seq_len_to_capture: longest sequence a decode graph covers; longer ones decode eagerly
            (`--max-seq-len-to-capture`, default 8192).
        speculative_config: speculative decoding, as a dict, its JSON text (vLLM's keys, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 3}``) or a `SpeculativeConfig`; none: plain decoding.
        kv_transfer_config: prefill/decode disaggregation (vLLM's `--kv-transfer-config` keys), as a dict, its
            JSON text or a `KVTransferConfig`.
        **engine_args: fields of `CacheConfig` (block_size, cache_memory, num_blocks, num_state_slots,
            host_cache_memory / kv_offloading_size for the host tier, shared_cache_url for the shared store),
            `SchedulerConfig` (max_num_batched_tokens, max_num_seqs, policy, watchdog_timeout_s) and
            `ParallelConfig` (tensor_parallel_size, enable_expert_parallel, enable_eplb; distributed_executor_backend:
            "uni" for one rank in this process (the default for one rank), "mp" for worker processes (the default
            for several) or "ray" (ray_address); data_parallel_size: N > 1 runs N engine processes behind a
            router, each with its share of the CPU threads, and load_balance_method).
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", max_model_len: int | None = None,
                 seed: int = 0, structured_output_backend: str = "llguidance", device: str = "cpu",
                 num_threads: int | None = None, enforce_eager: bool = False,
                 cuda_graph_sizes: Sequence[int] | None = None, max_seq_len_to_capture: int = 8192,
                 speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
                 kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None,
                 **engine_args: Any) -> None:
        if model is None:  # the embedded default model, shipped as package data
            model = str(default_model_dir())
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        parallel_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
        unknown = set(engine_args) - cache_fields - sched_fields - parallel_fields
        if unknown:
            raise ValueError(f"unknown engine argument(s) {sorted(unknown)} "
                             f"(supported: {sorted(cache_fields | sched_fields | parallel_fields)})")
        config = EngineConfig(
            model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
            num_threads=num_threads, structured_output_backend=structured_output_backend, enforce_eager=enforce_eager,
            cuda_graph_sizes=None if cuda_graph_sizes is None else tuple(cuda_graph_sizes),
            max_seq_len_to_capture=max_seq_len_to_capture,
            cache=CacheConfig(**{k: v for k, v in engine_args.items() if k in cache_fields}),
            scheduler=SchedulerConfig(**{k: v for k, v in engine_args.items() if k in sched_fields}),
            parallel=ParallelConfig(**{k: v for k, v in engine_args.items() if k in parallel_fields}),
            speculative_config=None if speculative_config is None else SpeculativeConfig.from_json(speculative_config),
            kv_transfer_config=None if kv_transfer_config is None else KVTransferConfig.from_json(kv_transfer_config),
        )
        vision = ModelConfig.from_pretrained(model).vision  # fails on a bad checkpoint config before anything else
        self._vision = None if vision is None else (ImageProcessingConfig.for_vision(vision),
                                                    vision.media_placeholder_token_id)
        """How prompts' images are preprocessed and which token they replace (None: the model takes none)."""
        self.tokenizer = Tokenizer.from_pretrained(model)
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        """Private to this object: `generate` runs on it (in the calling thread, or in `_thread` when that thread
        already runs an event loop)."""
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[Any] | None = None
        weakref.finalize(self, _close, self._loop)
        self._core: EngineCore | None = None
        self._client: InprocEngineClient | DPEngineClient
        if config.parallel.data_parallel_size > 1:
            self._client = self._run(DPEngineClient.start(config))
            weakref.finalize(self, _shutdown, self._loop, self._client)
        else:
            self._core = EngineCore(config)
            self._client = InprocEngineClient(self._core)
        self.eos_token_ids = frozenset(self._client.info.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._output = OutputProcessor(self._client, eos_token_ids=self.eos_token_ids)

    @property
    def engine(self) -> EngineCore:
        """The engine core, stepped by `generate` (its scheduler, cache, stats and step observer are public).
        With data_parallel_size > 1 there is none in this process (the replicas run in engine processes of their
        own): AttributeError; `client` is the `DPEngineClient` over them."""
        if self._core is None:
            raise AttributeError("LLM.engine: with data_parallel_size > 1 the engines run in processes of their own; "
                                 "LLM.client is the DPEngineClient over them")
        return self._core

    @property
    def client(self) -> InprocEngineClient | DPEngineClient:
        """The engine client `generate` runs on: an `InprocEngineClient` over `engine`, or with data parallelism a
        `DPEngineClient` (its `replicas`, `router` and `pids`)."""
        return self._client

    def shutdown(self) -> None:
        """Stop the engine processes of a data-parallel LLM (also done when it is garbage-collected); nothing to do
        for an in-process engine. The LLM cannot generate afterwards."""
        if isinstance(self._client, DPEngineClient):
            self._run(self._client.shutdown())

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a `MultiModalPrompt` dict with images),
        all batched together.

        Returns one RequestOutput per prompt, in order, each with `params.n` outputs. Bad arguments raise
        ValueError or TypeError before anything is queued (a request the engine core itself refuses raises the
        core's ValueError); an exception (or KeyboardInterrupt) part-way aborts every request of the call. A
        sequence the engine ends with an error (its grammar failed to compile) gets finish_reason "error"; a failed
        engine step raises its exception.
        """
        if not isinstance(prompts, (str, list, tuple, dict)):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those, got "
                            f"{type(prompts).__name__}")
        prompt_list: list[Prompt]
        if isinstance(prompts, (str, dict)):
            prompt_list = [prompts]
        elif isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
            prompt_list = [prompts]
        else:
            prompt_list = list(prompts)
        # Everything is checked before any request is queued: a failure half-way would leave requests behind.
        params_list = _broadcast(SamplingParams() if sampling_params is None else sampling_params, len(prompt_list))
        priorities = _priorities(priority, len(prompt_list))
        encoded, images = [], []
        for prompt in prompt_list:
            ids, placed = self._encode(prompt)
            encoded.append(ids)
            images.append(placed)
        for ids in encoded:
            if self._core is not None:
                self._core.validate_prompt(ids)
            else:
                _validate_prompt(ids, self._client.info)
        results = [RequestOutput(request_id=str(next(self._ids)), prompt=_prompt_text(prompt),
                                 prompt_token_ids=ids, outputs=[], finished=False)
                   for prompt, ids in zip(prompt_list, encoded, strict=True)]
        start = time.perf_counter()
        self._run(self._generate(results, params_list, priorities, images))
        for r in results:
            r.finished = True
        logger.debug("generated %d sequences in %.2f s", sum(len(r.outputs) for r in results),
                     time.perf_counter() - start)
        return results

    def _encode(self, prompt: Prompt) -> tuple[list[int], tuple[ImageInput, ...]]:
        if isinstance(prompt, dict):
            return self._encode_multimodal(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), ()
        if not isinstance(prompt, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt must be a string, a list of int token ids or a prompt dict, got {prompt!r:.80}")
        return list(prompt), ()

    def _encode_multimodal(self, prompt: MultiModalPrompt) -> tuple[list[int], tuple[ImageInput, ...]]:
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise TypeError(f"a prompt dict has 'prompt' or 'prompt_token_ids' (one of them) and optionally "
                            f"'multi_modal_data', got keys {sorted(prompt)}")
        ids, _ = self._encode(prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"])
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes only 'image' here, got {data!r:.80}")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return ids, ()
        if self._vision is None:
            raise ValueError("multi_modal_data: this model has no vision tower: it cannot take images")
        processing, placeholder_id = self._vision
        return place_images(ids, images, processing, placeholder_id)

    async def _generate(self, results: list[RequestOutput], params_list: list[SamplingParams],
                        priorities: list[int], images: list[tuple[ImageInput, ...]]) -> None:
        """One task per output sequence, started in prompt order (so requests reach the engine in that order);
        the first task that fails cancels the others, whose streams abort their requests."""
        tasks = []
        for result, params, priority, placed in zip(results, params_list, priorities, images, strict=True):
            for seq in self._output.sequences(result.request_id, result.prompt_token_ids, params, self._processor):
                result.outputs.append(CompletionOutput(index=seq.index, text="", token_ids=[], finish_reason=None))
                tasks.append(asyncio.create_task(self._collect(result, seq, priority, placed)))
        if not tasks:
            return
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _processor(self, params: SamplingParams) -> TextProcessor:
        return TextProcessor(self.tokenizer, params)

    async def _collect(self, result: RequestOutput, seq: SequenceState, priority: int,
                       images: tuple[ImageInput, ...]) -> None:
        """Fill `result.outputs[seq.index]` from the sequence's updates."""
        out = result.outputs[seq.index]
        texts: list[str] = []
        logprobs: list[TokenLogprobs | None] = []
        failure: BaseException | None = None
        try:
            async with contextlib.aclosing(self._output.stream(seq, result.prompt_token_ids, priority=priority,
                                                               images=images)) as updates:
                async for update in updates:
                    if seq.index == 0 and not out.token_ids:
                        result.num_cached_tokens = update.num_cached_tokens
                        if update.prompt_logprobs is not None:
                            result.prompt_logprobs = [None, *update.prompt_logprobs]
                    out.token_ids.extend(update.token_ids)
                    logprobs.extend(update.logprobs)
                    texts.append(update.delta.content)
                    out.finish_reason = update.finish_reason
        except EngineRequestError as exc:
            # Chained: the core refused the request (its ValueError) or a step failed (its exception): raised as
            # the core raised it. Not chained: the engine ended the sequence with an error (a grammar). A
            # KeyboardInterrupt in a step has already left the event loop; raising it again here would stop the
            # loop once more, inside the clean-up.
            if isinstance(exc.__cause__, Exception):
                failure = exc.__cause__
            out.finish_reason = FinishReason.ERROR.value
        if failure is not None:
            raise failure
        out.text = "".join(texts)
        out.logprobs = logprobs if any(lp is not None for lp in logprobs) else None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion on the private loop: in this thread, or in a helper thread when this thread
        already runs an event loop (a notebook), since loops do not nest."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            in_a_loop = False
        else:
            in_a_loop = True
        if not in_a_loop:  # outside the except block: its RuntimeError must not become every error's context
            return self._run_here(coro)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deltaserve-llm")
        future = self._thread.submit(self._run_here, coro)
        try:
            return future.result()
        except BaseException:
            if not future.done():  # interrupted while waiting: stop the run there, let it abort its requests
                self._loop.call_soon_threadsafe(self._cancel)
                concurrent.futures.wait([future])
            raise

    def _run_here(self, coro: Coroutine[Any, Any, T]) -> T:
        task = self._task = self._loop.create_task(coro)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            # A KeyboardInterrupt may have stopped the loop with the task still running: cancel it and let it
            # finish, which closes its streams and so aborts its requests in the engine.
            task.cancel()
            with contextlib.suppress(BaseException):  # the first exception is the one to raise
                self._loop.run_until_complete(task)
            raise
        finally:
            self._task = None

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _close(loop: asyncio.AbstractEventLoop) -> None:
    if not loop.is_running():
        loop.close()


def _shutdown(loop: asyncio.AbstractEventLoop, client: DPEngineClient) -> None:
    """Stop a data-parallel LLM's engine processes when it is collected (each replica also kills its process at
    the interpreter's exit)."""
    if not loop.is_closed() and not loop.is_running():
        loop.run_until_complete(client.shutdown())


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _validate_prompt(ids: list[int], info: EngineInfo) -> None:
    """`EngineCore.validate_prompt` from the engine's facts, for engines in other processes (the same errors)."""
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {info.vocab_size})")
    if len(ids) >= info.max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {info.max_model_len} "
                         "(room for one generated token is needed)")


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or len(params) != n:
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt), got "
                         f"{params!r:.80}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return list(params)


def _priorities(priority: Sequence[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if not isinstance(priority, (list, tuple)) or len(priority) != n:
        raise ValueError(f"priority must be a list of {n} integers (one per prompt), got {priority!r:.80}")
    for i, p in enumerate(priority):
        if not isinstance(p, int) or isinstance(p, bool):
            raise TypeError(f"priority[{i}] must be an integer, got {p!r}")
    return list(priority)
