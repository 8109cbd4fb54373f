"""`EngineCore`: the step loop. `step()` = schedule -> execute (model + sampling) -> update the requests."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.planner import plan_cache
from deltaserve.cache.spec import StateCacheSpec
from deltaserve.config import EngineConfig, ModelConfig, parse_memory
from deltaserve.models.loader import load_model
from deltaserve.request import FinishReason, Request
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[object | None]
    """Per new token a `runner.sampler.TokenLogprobs`, or None when not requested."""
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0


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
        self.model_config = ModelConfig.from_pretrained(config.model)
        model = load_model(config.model, dtype=getattr(torch, config.dtype))
        model_limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        device = next(model.parameters()).device
        cc = config.cache
        specs = model.cache_specs()
        budget = parse_memory(cc.cache_memory, available_memory_bytes(device))
        per_slot = sum(s.bytes_per_slot for s in specs if isinstance(s, StateCacheSpec))
        num_ckpt = 0
        if cc.enable_prefix_caching and per_slot:
            num_ckpt = cc.num_checkpoint_slots
            if num_ckpt is None:
                num_ckpt = parse_memory(cc.checkpoint_memory, budget) // per_slot
            logger.info("prefix cache: %d state checkpoint slots (%.1f MiB)", num_ckpt, num_ckpt * per_slot / 2**20)
        layout = plan_cache(
            specs, budget_bytes=max(budget - num_ckpt * per_slot, 0), block_size=cc.block_size,
            max_num_seqs=config.scheduler.max_num_seqs, num_blocks=cc.num_blocks, num_slots=cc.num_state_slots,
        )
        self.cache = CacheManager(
            num_blocks=layout.num_blocks, num_slots=layout.num_slots, block_size=cc.block_size,
            num_checkpoint_slots=num_ckpt, bytes_per_slot=per_slot, enable_prefix_caching=cc.enable_prefix_caching,
            checkpoint_interval=cc.state_checkpoint_interval,
        )
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.runner = ModelRunner(model, num_blocks=layout.num_blocks, block_size=cc.block_size,
                                  num_slots=layout.num_slots + num_ckpt)
        self.stats = StepStats()
        self._arrivals = itertools.count()
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
        self.validate_prompt(prompt_token_ids)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, stop_token_ids=stops,
            arrival_index=next(self._arrivals), priority=priority, max_total_tokens=self.max_model_len,
        ))

    def abort_request(self, request_id: str) -> None:
        """Cancel a request at any time; every block and slot it held is freed. Unknown ids are ignored."""
        self.scheduler.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request early with `reason` (a stop string found by the detokenizer)."""
        self.scheduler.finish_request(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration: schedule, run the model and the sampler, update every scheduled request."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        events = self.scheduler.update_from_output(out, result)
        self.stats.steps += 1
        self.stats.total_seconds += time.perf_counter() - start
        self.stats.forward_seconds += result.forward_seconds
        return [
            EngineCoreOutput(request_id=e.request.request_id, new_token_ids=[e.token.token_id],
                             logprobs=[e.token.logprobs], finish_reason=e.finish_reason,
                             num_cached_tokens=e.request.num_cached_tokens or 0)
            for e in events
        ]
