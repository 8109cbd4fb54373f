"""`EngineCore`: the step loop. `step()` = schedule -> execute (model + sampling) -> update the requests."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.planner import plan_cache
from deltaserve.cache.spec import StateCacheSpec
from deltaserve.config import EngineConfig, ModelConfig, parse_memory
from deltaserve.engine.stats import EngineStats
from deltaserve.models.loader import load_model
from deltaserve.request import FinishReason, Request
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import SchedulerOutput
from deltaserve.scheduler.scheduler import Scheduler, StepEvent
from deltaserve.structured.manager import StructuredOutputManager
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.utils.malloc import keep_freed_memory

logger = logging.getLogger(__name__)

IDLE_COMPILE_WAIT_S = 0.05
"""With nothing to run but grammars compiling, `step()` waits this long at most for one to finish."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[object | None]
    """Per new token a `runner.sampler.TokenLogprobs`, or None when not requested."""
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    error: str | None = None
    """Why the request finished with FinishReason.ERROR (e.g. its grammar failed to compile); None otherwise."""
    prompt_logprobs: list[object] | None = None
    """On a request's first output, with params.prompt_logprobs: a `TokenLogprobs` per prompt token after the
    first."""


@dataclass(slots=True)
class StepStats:
    """Cumulative timing, to report the share of a step spent outside the model forward."""

    steps: int = 0
    total_seconds: float = 0.0
    forward_seconds: float = 0.0

    @property
    def overhead_share(self) -> float:
        return 1.0 - self.forward_seconds / self.total_seconds if self.total_seconds else 0.0


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class EngineCore:
    """Owns the scheduler, the cache manager and the model runner of one model replica."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r}, but this torch ({torch.__version__}) sees no CUDA device")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu" and not keep_freed_memory():  # steps reuse their temporaries (utils/malloc.py)
            logger.info("not glibc: malloc left as it is")
        self.model_config = ModelConfig.from_pretrained(config.model)
        model = load_model(config.model, dtype=getattr(torch, config.dtype), device=config.device)
        model_limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        device = next(model.parameters()).device
        cc = config.cache
        specs = model.cache_specs()
        available = available_memory_bytes(device)
        budget = parse_memory(cc.cache_memory, available)
        per_slot = sum(s.bytes_per_slot for s in specs if isinstance(s, StateCacheSpec))
        num_ckpt = 0
        if cc.enable_prefix_caching and per_slot:
            num_ckpt = cc.num_checkpoint_slots
            if num_ckpt is None:
                num_ckpt = parse_memory(cc.checkpoint_memory, budget, "checkpoint_memory") // per_slot
            logger.info("prefix cache: %d state checkpoint slots (%.1f MiB)", num_ckpt, num_ckpt * per_slot / 2**20)
        layout = plan_cache(
            specs, budget_bytes=max(budget - num_ckpt * per_slot, 0), block_size=cc.block_size,
            max_num_seqs=config.scheduler.max_num_seqs, num_blocks=cc.num_blocks, num_slots=cc.num_state_slots,
        )
        needed = layout.total_bytes + num_ckpt * per_slot
        if needed > available:  # checked before allocating: a cache larger than memory takes the machine down
            raise ValueError(f"the cache needs {needed / 2**30:.2f} GiB (cache_memory={cc.cache_memory!r}, "
                             f"num_blocks={cc.num_blocks}, num_state_slots={cc.num_state_slots}) but only "
                             f"{available / 2**30:.2f} GiB are free on {device}")
        self.cache = CacheManager(
            num_blocks=layout.num_blocks, num_slots=layout.num_slots, block_size=cc.block_size,
            num_checkpoint_slots=num_ckpt, bytes_per_slot=per_slot, enable_prefix_caching=cc.enable_prefix_caching,
            checkpoint_interval=cc.state_checkpoint_interval,
        )
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.runner = ModelRunner(model, num_blocks=layout.num_blocks, block_size=cc.block_size,
                                  num_slots=layout.num_slots + num_ckpt)
        self.stats = StepStats()
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None
        """Called after every step with what was scheduled and the step's seconds (benchmarks use it)."""
        self._in_step: tuple[list[EngineCoreOutput], list[str]] | None = None
        """During a step: the outputs it made before scheduling and the requests it held (see fail_unfinished)."""
        self.structured = StructuredOutputManager(
            config.structured_output_backend, lambda: Tokenizer.from_pretrained(config.model),
            self.model_config.vocab_size,
        )
        self._arrivals = itertools.count()
        self._prompt_logprobs: dict[str, list[object]] = {}
        """Prompt logprobs computed by prefill chunks, until the request's first output carries them."""
        torch.manual_seed(config.seed)  # the shared generator of unseeded sampling

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError for an empty, out-of-vocabulary or too long prompt."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(room for one generated token is needed)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    eos_token_ids: frozenset[int] = frozenset(), priority: int = 0) -> None:
        """Queue a request (n must be 1 here: the frontend fans n out). ValueError on bad input."""
        if params.n != 1:
            raise ValueError("EngineCore.add_request takes n=1 sampling params; fan out n in the frontend")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        self.validate_prompt(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if params.allowed_token_ids is not None and not any(t < vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids has no token in the vocabulary [0, {vocab})")
        if self.structured.is_pending(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, stop_token_ids=stops,
            arrival_index=next(self._arrivals), priority=priority, max_total_tokens=self.max_model_len,
        )
        if params.structured is None:
            self.scheduler.add_request(request)
        else:  # compiled in a thread; queued in the scheduler by the first step() after it is ready
            self.scheduler.check_request(request)
            self.structured.submit(request)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request at any time; every block and slot it held is freed. Unknown ids are ignored."""
        self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request early with `reason` (a stop string found by the detokenizer); frees its grammar too."""
        request = self.structured.cancel(request_id) or self.scheduler.finish_request(request_id, reason)
        self._prompt_logprobs.pop(request_id, None)
        if request is not None:
            request.grammar = None

    def fail_unfinished(self, error: str) -> list[EngineCoreOutput]:
        """After `step` raised: end every request the step held or the scheduler holds with `error` (one output
        each; the failed-compile outputs the step had already made come first), release the step's copy pins,
        drop the runner's per-request state and forget the prefix cache, since the failed step may have
        registered blocks and states it never finished writing. Requests still compiling a grammar stay."""
        made, held = self._in_step or ([], [])
        self._in_step = None
        ids = list(dict.fromkeys([*held, *self.scheduler.requests]))
        self.cache.end_step()
        for request_id in ids:
            self.finish_request(request_id, FinishReason.ERROR)
        self.runner.forget_requests()
        self.reset_prefix_cache()
        return made + [EngineCoreOutput(request_id=rid, new_token_ids=[], logprobs=[], finish_reason=FinishReason.ERROR,
                                        num_cached_tokens=0, error=error) for rid in ids]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.num_pending > 0

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached KV block and state checkpoint (running requests are unaffected).

        Returns (blocks uncached, checkpoints dropped)."""
        return self.cache.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        """A snapshot for metrics (named `get_stats` because `self.stats` holds the step timings)."""
        usage, prefix = self.cache.usage(), self.cache.prefix_stats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=usage.num_blocks - usage.num_free_blocks, kv_blocks_total=usage.num_blocks,
            state_slots_used=usage.num_slots - usage.num_free_slots, state_slots_total=usage.num_slots,
            prefix_queried_tokens=prefix.queried_tokens, prefix_hit_tokens=prefix.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, steps=self.stats.steps,
            step_seconds=self.stats.total_seconds, forward_seconds=self.stats.forward_seconds,
        )

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration: schedule, run the model and the sampler, update every scheduled request.

        Requests whose grammar finished compiling join the scheduler first (a failed compile yields one output
        with FinishReason.ERROR); constrained sampling rows get their grammar's token bitmask.
        """
        if self.structured.num_pending and not self.scheduler.has_unfinished():
            self.structured.wait(IDLE_COMPILE_WAIT_S)  # nothing else to run: do not spin while grammars compile
        start = time.perf_counter()
        outputs = self._admit_compiled()
        self._in_step = (list(outputs), list(self.scheduler.requests))  # what fail_unfinished reports if it raises
        out = self._with_grammar_bitmask(self.scheduler.schedule())
        result = self.runner.execute(out)
        for rid, entries in result.prompt_logprobs.items():  # held until the request's first token
            self._prompt_logprobs.setdefault(rid, []).extend(entries)
        events = self.scheduler.update_from_output(out, result)
        rejected = self._advance_grammars(events)
        elapsed = time.perf_counter() - start
        self.stats.steps += 1
        self.stats.total_seconds += elapsed
        self.stats.forward_seconds += result.forward_seconds
        if self.step_observer is not None:
            self.step_observer(out, elapsed)
        for e in events:
            error = rejected.get(e.request.request_id)
            outputs.append(EngineCoreOutput(
                request_id=e.request.request_id, new_token_ids=[e.token.token_id], logprobs=[e.token.logprobs],
                finish_reason=e.finish_reason if error is None else FinishReason.ERROR,
                num_cached_tokens=e.request.num_cached_tokens or 0, error=error,
                prompt_logprobs=self._first_prompt_logprobs(e.request),
            ))
        self._in_step = None
        return outputs

    def _first_prompt_logprobs(self, request: Request) -> list[object] | None:
        """The prompt logprobs for the output of a request's first token ([] for a one-token prompt, which has
        nothing to score); None on later outputs and for requests that did not ask."""
        if request.params.prompt_logprobs is None or len(request.output_token_ids) != 1:
            return None
        return self._prompt_logprobs.pop(request.request_id, [])

    # -- structured output ---------------------------------------------------------------------------------------

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is ready; finish those whose compile failed, one output each."""
        if not self.structured.num_pending:
            return []
        compiled, failed = self.structured.take_finished()
        for request in compiled:
            self.scheduler.add_request(request)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], logprobs=[],
                                 finish_reason=FinishReason.ERROR, error=message) for r, message in failed]

    def _with_grammar_bitmask(self, out: SchedulerOutput) -> SchedulerOutput:
        """Attach the token bitmask of every constrained request that samples this step (none: `out` unchanged)."""
        requests = self.scheduler.requests
        ids = [c.request_id for c in out.chunks if c.sample and requests[c.request_id].grammar is not None]
        if not ids:
            return out
        bitmask = self.structured.bitmask([requests[rid].grammar for rid in ids])
        return replace(out, structured_request_ids=ids, grammar_bitmask=bitmask)

    def _advance_grammars(self, events: list[StepEvent]) -> dict[str, str]:
        """Feed every constrained request its new token (once: recompute never re-feeds). A token the grammar
        rejects finishes the request with an error (by id -> message); a finished request's grammar is dropped."""
        rejected: dict[str, str] = {}
        for e in events:
            request, grammar = e.request, e.request.grammar
            if grammar is None:
                continue
            if e.finish_reason is None and not grammar.accept_token(e.token.token_id):
                rejected[request.request_id] = f"the structured-output grammar rejected token {e.token.token_id}"
                logger.error("request %s: %s", request.request_id, rejected[request.request_id])
                self.scheduler.finish_request(request.request_id, FinishReason.ERROR)
            if request.is_finished:
                request.grammar = None
        return rejected
