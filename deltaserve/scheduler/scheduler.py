"""The phase-less scheduler: each step gives tokens to requests under a token budget, decodes first.

Policy, in order, every step:
1. Running requests that decode (one token) are scheduled first, then running prefill chunks, so a long prefill
   never starves decodes. Each needs blocks for its tokens; when the pools are full, a victim that has not been
   scheduled this step is preempted (the latest arrival under FCFS; the lowest priority, then latest, under
   'priority') until the allocation fits. The victim may be the request itself.
2. If nothing was preempted, waiting requests are admitted in queue order while the budget, `max_num_seqs` and
   the pools allow: all or nothing on both pools (blocks for the first chunk and a state slot).

Preemption is by recompute: the victim's blocks and slot are freed and its `num_computed_tokens` reset to 0; it
goes back to the waiting queue ahead of later arrivals and re-prefills prompt + output so far. Its output is
unchanged (greedy, or seeded sampling: the sampler's per-request generator is only consumed when a token is
sampled). Progress is guaranteed because the oldest running request can always evict every other, and a request
that could not fit an empty cache is rejected when added.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.cache.manager import CacheManager
from deltaserve.config import SchedulerConfig
from deltaserve.request import FinishReason, Request, RequestStatus
from deltaserve.scheduler.output import (
    NewRequestData,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from deltaserve.scheduler.queue import WaitingQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepEvent:
    """The tokens a request gained in one step (one, or several in a speculative step), and whether they finished
    it (then the last token is the one that did)."""

    request: Request
    tokens: list[SampledToken]
    finish_reason: FinishReason | None
    num_proposed: int = 0
    """Proposed tokens the step verified (speculative decoding)."""
    num_accepted: int = 0
    """Of which the verification accepted (tokens after a stop among them are still counted)."""


class Scheduler:
    """Owns the waiting queue and the running set; talks to memory only through the CacheManager."""

    def __init__(self, cfg: SchedulerConfig, cache: CacheManager, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.cache, self.clock = cfg, cache, clock
        self.waiting = WaitingQueue(cfg.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._unsent: set[str] = set()
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        self._last_progress = clock()
        self._stall_logged = False

    # -- requests in and out -------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if its id is taken or it could never fit an empty cache."""
        self.check_request(request)
        if not self.requests:  # idle until now: the watchdog counts from this arrival, not from the last request
            self._last_progress, self._stall_logged = self.clock(), False
        self.requests[request.request_id] = request
        self._unsent.add(request.request_id)
        self.waiting.push(request)

    def check_request(self, request: Request) -> None:
        """What `add_request` checks, without queuing: ValueError if the id is taken or it could never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        need = request.max_tokens_needed
        if not self.cache.can_ever_fit(need):
            raise ValueError(
                f"request needs up to {need} tokens of KV ({self.cache.blocks_for(need)} blocks) but the cache has "
                f"{self.cache.blocks.num_blocks} blocks of {self.cache.block_size}: lower max_tokens or raise "
                "cache_memory"
            )

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a request early (abort, or a stop string seen by the detokenizer); frees its cache."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request_id)
        self._finish(request, reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        preempted = False
        # Decodes first, then prefill chunks; stable, so arrival order holds within each group.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, n, scheduled):
                chunks.append(self._chunk(request, n))
                scheduled.add(request.request_id)
                budget -= n
            else:
                preempted = True
        # Proposals only once every running request has its blocks, from what is left: they never preempt.
        for i, chunk in enumerate(chunks):
            request = self.requests[chunk.request_id]
            if budget > 0 and request.spec_token_ids and request.status is RequestStatus.RUNNING:
                proposed = self._proposed_chunk(request, budget + len(chunk.new_token_ids))
                if proposed is not None:
                    chunks[i] = proposed
                    budget -= proposed.num_proposed
        if not preempted:
            budget = self._admit_waiting(budget, chunks, scheduled)
        self._watch()
        new = [self._new_data(self.requests[rid]) for rid in scheduled if rid in self._unsent]
        self._unsent.difference_update(scheduled)
        finished, self._finished_since_step = self._finished_since_step, []
        block_copies, state_copies = self.cache.take_copies()
        return SchedulerOutput(chunks=chunks, new_requests=new, finished_request_ids=finished,
                               block_copies=block_copies, state_copies=state_copies,
                               host_copies=self.cache.take_host_copies(), shared_ops=self.cache.take_shared_ops(),
                               remote_fetches=self.cache.take_remote_fetches())

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[StepEvent]:
        """Advance the computed counters, append sampled tokens, finish requests that hit a stop condition."""
        events = []
        self.cache.end_step()
        if out.shared_ops is not None and out.shared_ops.fetches:
            self.cache.finish_fetches(result.shared_fetched)
        if out.remote_fetches:
            self.cache.finish_remote(result.transfer.fetched if result.transfer is not None else [])
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.spec_token_ids = []
            self._last_progress, self._stall_logged = self.clock(), False
            if not chunk.sample:
                request.num_computed_tokens += len(chunk.new_token_ids)
                self.cache.commit(request)
                continue
            tokens: list[SampledToken] = []
            reason = None
            for token in result.sampled[chunk.request_id]:  # accepted proposals, then the sampled token
                tokens.append(token)
                request.output_token_ids.append(token.token_id)
                reason = self._stop_reason(request, token.token_id)
                if reason is not None:  # tokens after a stop are dropped, and their state with them
                    break
            accepted = len(tokens) - 1
            request.num_computed_tokens += len(chunk.new_token_ids) - chunk.num_proposed + accepted
            if chunk.num_proposed:
                self.cache.commit_proposed(request, accepted)
            self.cache.commit(request)
            events.append(StepEvent(request, tokens, reason, num_proposed=chunk.num_proposed,
                                    num_accepted=len(result.sampled[chunk.request_id]) - 1))
            if reason is not None:
                self._finish(request, reason)
        return events

    # -- helpers -------------------------------------------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, n: int, scheduled: set[str]) -> bool:
        """Allocate for n more tokens, preempting unscheduled victims as needed. False if `request` was preempted."""
        while not self.cache.allocate(request.request_id, request.num_computed_tokens + n):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=self._victim_key)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim_key(self, r: Request) -> tuple[int, int]:
        return (r.priority if self.cfg.policy == "priority" else 0, r.arrival_index)

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk], scheduled: set[str]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting.peek()
            if self.cache.prefetch(request) or self.cache.prefetch_remote(request):
                break  # its prefix is being fetched (shared store, prefill instance) this step: admitted after it
            hit = self.cache.match(request)
            if self._inflight_prefix(request, hit.length):
                break  # a running prefill is about to checkpoint more of this prompt: wait for it
            n = min(request.num_tokens - hit.length, budget)
            if not self.cache.allocate(request.request_id, hit.length + n, hit):
                break  # all or nothing; keep queue order (no overtaking)
            request.num_computed_tokens = hit.length
            self.cache.record_query(request.num_tokens, hit.length)  # resumptions after preemption count too
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.length
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n
        return budget

    def _inflight_prefix(self, request: Request, hit_length: int) -> bool:
        """Whether a running request's prefill will soon checkpoint a shared prefix covering at least half of
        what this prompt would otherwise compute (waiting for a small gain would only delay it)."""
        if not self.cache.enable_prefix_caching or request.skip_prefix_cache:
            return False
        bs = self.cache.block_size
        mine = self.cache.hashes(request, (request.num_prompt_tokens - 1) // bs)
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            theirs = self.cache.hashes(other, other.num_prompt_tokens // bs)
            shared = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                          min(len(mine), len(theirs)))
            planned = self.cache.planned_positions(other)
            gain_needed = hit_length + (request.num_prompt_tokens - hit_length) / 2
            if any(gain_needed <= p <= shared * bs and p > other.num_computed_tokens for p in planned):
                return True
        return False

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        sample = start + n == request.num_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            new_token_ids=request.token_slice(start, start + n),
            num_computed_tokens=start,
            state_slot=self.cache.slot(request.request_id),
            block_ids=self.cache.block_ids(request.request_id).snapshot(),
            reset_state=start == 0,
            sample=sample,
            checkpoints=tuple(self.cache.plan_checkpoints(request, start, start + n)),
            kv_send=request.kv_send if sample else None,
        )

    def _proposed_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        """A decode that also verifies the request's proposed tokens, as many as the budget, its length limits,
        free blocks (no preemption for proposals) and scratch slots allow; None to decode without them."""
        if request.num_tokens - request.num_computed_tokens != 1:
            return None
        room = min(request.params.max_tokens - len(request.output_token_ids),
                   request.max_total_tokens - request.num_tokens)  # tokens this request may still gain
        k = min(len(request.spec_token_ids), budget - 1, room - 1)
        if k < 1 or not self.cache.allocate(request.request_id, request.num_tokens + k):
            return None
        scratch = self.cache.allocate_scratch(request.request_id, k)
        if scratch is None:
            return None
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            new_token_ids=[*request.token_slice(start, start + 1), *request.spec_token_ids[:k]],
            num_computed_tokens=start, state_slot=self.cache.slot(request.request_id),
            block_ids=self.cache.block_ids(request.request_id).snapshot(), sample=True,
            checkpoints=tuple((i + 1, slot) for i, slot in enumerate(scratch)), num_proposed=k,
        )

    def _new_data(self, request: Request) -> NewRequestData:
        return NewRequestData(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                              params=request.params, stop_token_ids=request.stop_token_ids, images=request.images)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        if token in request.stop_token_ids and len(request.output_token_ids) >= request.params.min_tokens:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.params.max_tokens or request.num_tokens >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.cache.free(request)  # with prefix caching its state is kept as a checkpoint: resumption hits it
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.push(request)
        self.num_preemptions += 1

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.cache.free(request)  # with prefix caching: a checkpoint at its end, for the next turn of a chat
        if request in self.running:
            self.running.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        del self.requests[request.request_id]
        if request.request_id in self._unsent:
            self._unsent.discard(request.request_id)
        else:
            self._finished_since_step.append(request.request_id)

    def _watch(self) -> None:
        """The watchdog: log an error when requests are pending but none progressed for watchdog_timeout_s."""
        now = self.clock()
        if not self.requests:
            self._last_progress = now
            return
        stalled = now - self._last_progress
        if stalled > self.cfg.watchdog_timeout_s and not self._stall_logged:
            self._stall_logged = True
            usage = self.cache.usage()
            logger.error(
                "no request progressed for %.0f s: %d running, %d waiting, %d/%d blocks and %d/%d slots free",
                stalled, len(self.running), len(self.waiting), usage.num_free_blocks, usage.num_blocks,
                usage.num_free_slots, usage.num_slots,
            )

    @property
    def stalled(self) -> bool:
        """True once the watchdog has fired (until a request progresses again)."""
        return self._stall_logged
