"""`LLM`: the offline Python API (vLLM-style): `LLM(model=PATH).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deltaserve.default_model import default_model_dir
from deltaserve.engine.engine_core import EngineCore
from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams, child_seed
from deltaserve.text.detokenizer import IncrementalDetokenizer
from deltaserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass(slots=True)
class _Sequence:
    """Frontend bookkeeping of one output sequence."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    request: RequestOutput | None = None
    logprobs: list[Any] = field(default_factory=list)


class LLM:
    """Generate from a Kimi Linear checkpoint directory with the continuous-batching engine.

    Args:
        model: checkpoint directory (config.json, safetensors weights, tokenizer files); none loads the embedded
            default model (`deltaserve.default_model`).
        dtype: "float32" or "bfloat16" (router, gates and KDA state stay fp32).
        max_model_len: cap on prompt + output tokens (defaults to the model's own limit).
        seed: seed of the generator shared by unseeded sampling requests.
        structured_output_backend: "llguidance" (default) or "xgrammar", for `SamplingParams.structured`.
        **engine_args: fields of `CacheConfig` (block_size, cache_memory, num_blocks, num_state_slots) and
            `SchedulerConfig` (max_num_batched_tokens, max_num_seqs, policy, watchdog_timeout_s).
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", max_model_len: int | None = None,
                 seed: int = 0, structured_output_backend: str = "llguidance", device: str = "cpu",
                 **engine_args: Any) -> None:
        if model is None:  # the embedded default model, shipped as package data
            model = str(default_model_dir())
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = set(engine_args) - cache_fields - sched_fields
        if unknown:
            raise ValueError(f"unknown engine argument(s) {sorted(unknown)} "
                             f"(supported: {sorted(cache_fields | sched_fields)})")
        config = EngineConfig(
            model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
            structured_output_backend=structured_output_backend,
            cache=CacheConfig(**{k: v for k, v in engine_args.items() if k in cache_fields}),
            scheduler=SchedulerConfig(**{k: v for k, v in engine_args.items() if k in sched_fields}),
        )
        ModelConfig.from_pretrained(model)  # fail on a bad checkpoint config before reading anything else
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.engine = EngineCore(config)
        self.eos_token_ids = frozenset(self.engine.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids), all batched together.

        Returns one RequestOutput per prompt, in order, each with `params.n` outputs.
        """
        if not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got "
                            f"{type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # Everything is checked before any request is queued: a failure half-way would leave requests behind.
        params_list = _broadcast(SamplingParams() if sampling_params is None else sampling_params, len(prompts))
        priorities = _priorities(priority, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for ids in encoded:
            self.engine.validate_prompt(ids)
        results, live = self._add_all(prompts, encoded, params_list, priorities)
        start = time.perf_counter()
        try:
            self._run(live)
        except BaseException:
            for rid in list(live):
                self.engine.abort_request(rid)
            raise
        for r in results:
            r.finished = True
        logger.debug("generated %d sequences in %.2f s", sum(len(r.outputs) for r in results),
                     time.perf_counter() - start)
        return results

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt must be a string or a list of int token ids, got {prompt!r:.80}")
        return list(prompt)

    def _add_all(self, prompts, encoded, params_list, priority) -> tuple[list[RequestOutput], dict[str, _Sequence]]:
        results: list[RequestOutput] = []
        live: dict[str, _Sequence] = {}
        for i, (prompt, ids, params) in enumerate(zip(prompts, encoded, params_list, strict=True)):
            request_id = str(next(self._ids))
            outputs = []
            for j in range(params.n):
                child = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=child_seed(params.seed, j))
                rid = request_id if params.n == 1 else f"{request_id}-{j}"
                out = CompletionOutput(index=j, text="", token_ids=[], finish_reason=None)
                detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=child.skip_special_tokens, stop=child.stop,
                    include_stop_str_in_output=child.include_stop_str_in_output, min_tokens=child.min_tokens,
                )
                try:
                    self.engine.add_request(rid, ids, child, eos_token_ids=self.eos_token_ids, priority=priority[i])
                except BaseException:
                    for other in live:
                        self.engine.abort_request(other)
                    raise
                live[rid] = _Sequence(out, detok)
                outputs.append(out)
            result = RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                                   prompt_token_ids=ids, outputs=outputs, finished=False)
            for j in range(params.n):
                live[request_id if params.n == 1 else f"{request_id}-{j}"].request = result
            results.append(result)
        return results, live

    def _run(self, live: dict[str, _Sequence]) -> None:
        idle_steps = 0
        while live:
            events = self.engine.step()
            idle_steps = 0 if events else idle_steps + 1
            if idle_steps > 10_000:
                raise RuntimeError("the engine made no progress for 10,000 steps (see the watchdog log)")
            for ev in events:
                seq = live.get(ev.request_id)
                if seq is None:  # left behind by an earlier call that failed half-way: not ours to report
                    self.engine.abort_request(ev.request_id)
                    continue
                if not seq.output.token_ids and seq.output.index == 0:
                    seq.request.num_cached_tokens = ev.num_cached_tokens
                    if ev.prompt_logprobs is not None:
                        seq.request.prompt_logprobs = [None, *ev.prompt_logprobs]
                seq.output.token_ids.extend(ev.new_token_ids)
                seq.logprobs.extend(ev.logprobs)
                update = seq.detokenizer.push(ev.new_token_ids)
                reason = ev.finish_reason
                if update.stop_string is not None and reason is None:
                    self.engine.finish_request(ev.request_id, FinishReason.STOP)
                    reason = FinishReason.STOP
                if reason is not None:
                    if update.stop_string is None:
                        seq.detokenizer.finish()
                    seq.output.text = seq.detokenizer.text
                    seq.output.finish_reason = reason.value
                    seq.output.logprobs = seq.logprobs if any(lp is not None for lp in seq.logprobs) else None
                    del live[ev.request_id]


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
