"""`EngineCore`: the step loop. `step()` = hooks -> schedule -> execute (on the executor's workers) -> update.

The core keeps the scheduler and the cache manager, both bookkeeping only; the model, the cache tensors and the
sampler live in the workers behind an `Executor` (in this process by default, or one process per rank).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.planner import CacheLayout, plan_cache
from deltaserve.cache.remote import TransferResult
from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.config import EngineConfig, ModelConfig, RemotePrefill, check_parallel, parse_memory
from deltaserve.config.kv_transfer import parse_transfer_request, prompt_digest
from deltaserve.config.speculative import BLOCK_DRAFTERS
from deltaserve.engine.hooks import GrammarHook, ProposerHook, StepHook
from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.engine.stats import EngineStats, shared_store_stats
from deltaserve.executor import Executor, make_executor
from deltaserve.executor.shared_store import RankZeroLookup, open_shared_store
from deltaserve.kvstore.store import KVStoreStats
from deltaserve.multimodal.inputs import ImageInput, check_images, keyed_tokens
from deltaserve.outputs import TokenLogprobs
from deltaserve.request import FinishReason, Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import SchedulerOutput
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.spec_decode.adaptive import AdaptiveVerifier
from deltaserve.spec_decode.cost_model import StepCostModel, measure_cost_model
from deltaserve.spec_decode.factory import make_proposer
from deltaserve.spec_decode.metrics import SpecDecodeStats
from deltaserve.spec_decode.proposer import Proposer
from deltaserve.structured.manager import StructuredOutputManager
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.utils.host_memory import available_host_bytes

logger = logging.getLogger(__name__)

IDLE_COMPILE_WAIT_S = 0.05
"""With nothing to run but grammars compiling, `step()` waits this long at most for one to finish."""


@dataclass(slots=True)
class StepStats:
    """Cumulative timing, to report the share of a step spent outside the model forward."""

    steps: int = 0
    total_seconds: float = 0.0
    forward_seconds: float = 0.0
    host_copy_seconds: float = 0.0
    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_seconds: float = 0.0
    shared_store: KVStoreStats | None = None
    """Rank 0's shared-store counters, as the latest step reported them."""

    @property
    def overhead_share(self) -> float:
        return 1.0 - self.forward_seconds / self.total_seconds if self.total_seconds else 0.0


@dataclass(slots=True)
class TransferCounters:
    """Disaggregation counters the core adds up from the workers' step results (the cache manager counts fetches)."""

    sent: int = 0
    sent_kv_bytes: int = 0
    sent_state_bytes: int = 0
    received_kv_bytes: int = 0
    received_state_bytes: int = 0
    seconds: float = 0.0
    fallbacks: int = 0

    def add(self, result: TransferResult | None, world_size: int) -> set[str]:
        """Count one step's transfers (rank 0's: the KV bytes of all ranks together, each block moved by one rank;
        its state bytes times the ranks, every rank moving its heads' equal part); returns the requests whose cache
        was published."""
        if result is None:
            return set()
        self.sent += len(result.sent)
        for kv, state in result.sent.values():
            self.sent_kv_bytes += kv
            self.sent_state_bytes += state * world_size
        self.received_kv_bytes += result.received[0]
        self.received_state_bytes += result.received[1] * world_size
        self.seconds += result.seconds
        return set(result.sent)


class EngineCore:
    """The scheduler and cache bookkeeping of one model replica, driving its workers through an executor.

    `proposer`: speculative decoding; its proposals are verified in the same step (outputs are unchanged).
    """

    def __init__(self, config: EngineConfig, *, proposer: Proposer | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        model_limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        check_parallel(self.model_config, config.parallel)  # before any worker starts
        self.executor: Executor = make_executor(config)
        self.shared_store = open_shared_store(config)
        """The shared store's client of the scheduler (lookups only; the workers read and write entries)."""
        try:
            if proposer is None and config.speculative_config is not None:
                proposer = make_proposer(config.speculative_config, config)
            self._plan_cache(proposer)
            spec = config.speculative_config
            verifier = None
            if (proposer is not None and spec is not None and spec.method in BLOCK_DRAFTERS
                    and spec.enable_adaptive_verification):
                verifier = AdaptiveVerifier(self._measure_costs(proposer.num_speculative_tokens),
                                            proposer.num_speculative_tokens)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, self.cache)
        self.stats = StepStats()
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None
        """Called after every step with what was scheduled and the step's seconds (benchmarks use it)."""
        self._in_step: tuple[list[EngineCoreOutput], list[str]] | None = None
        """During a step: the outputs it made before scheduling and the requests it held (see fail_unfinished)."""
        self.structured = StructuredOutputManager(
            config.structured_output_backend, lambda: Tokenizer.from_pretrained(config.model),
            self.model_config.vocab_size,
        )
        self.grammar_hook = GrammarHook(self.scheduler, self.structured)
        self.hooks: list[StepHook] = [self.grammar_hook]
        self.proposer_hook = None if proposer is None else ProposerHook(
            self.scheduler, proposer, self.grammar_hook.grammars,
            disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None, verifier=verifier)
        if self.proposer_hook is not None:
            self.hooks.append(self.proposer_hook)
        self._arrivals = itertools.count()
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        """Prompt logprobs computed by prefill chunks, until the request's first output carries them."""
        self.engine_id = uuid.uuid4().hex[:12]
        self._transfer_ids = itertools.count()
        """Transfer ids are unique even when a request id is reused while an earlier payload still waits."""
        self._sends: dict[str, RemotePrefill] = {}
        """Prefill side: the transfer each producer request publishes, returned with its last output once sent."""
        self.transfer = TransferCounters()

    def _measure_costs(self, k: int) -> StepCostModel:
        """Adaptive verification's cost model: verification steps timed on the workers (batch sizes in powers of two
        up to `max_num_seqs`; 1, 2, 4 and k + 1 tokens per sequence, since the first verified draft costs more than
        the next ones; a short and a long context) and the drafter's forward,
        before any request. Logged as JSON."""
        start = time.perf_counter()
        sc, usage, block_size = self.config.scheduler, self.cache.usage(), self.config.cache.block_size
        batch = [b for b in (1 << i for i in range(12)) if b <= min(sc.max_num_seqs, usage.num_slots)]
        long_ctx = min(1024, self.max_model_len - k - 1, usage.num_blocks * block_size - k - 1)
        contexts = sorted({min(64, long_ctx), long_ctx})
        batch = [b for b in batch if b * (k + 1) <= sc.max_num_batched_tokens] or [1]
        for q in (1, k + 1):  # warm-up: first calls allocate (and load the decode and verify kernels)
            self.executor.time_step(batch[-1], q, contexts[-1])
        for b in batch:  # and the drafter's, per batch bucket (2026-12-07: its first calls took 2-2.6x the later
            for _ in range(2):  # ones, which made drafting look dear at batch 1)
                self.executor.time_draft(b)
        model = measure_cost_model(lambda b, t, c: self.executor.time_step(b, t // b, c), batch_sizes=batch,
                                   query_lens=sorted({1, 2, min(4, k + 1), k + 1}), context_lens=contexts,
                                   time_draft=self.executor.time_draft)
        logger.info("adaptive verification: step costs measured in %.1f s: %s", time.perf_counter() - start,
                    json.dumps(model.to_json()))
        return model

    def _plan_cache(self, proposer: Proposer | None) -> None:
        """Size the pools from the workers' free memory, tell the workers to allocate them, build the manager."""
        cc = self.config.cache
        info = self.executor.describe()
        self.transfer_addresses = info.transfer_addresses
        available = info.available_memory_bytes
        budget = parse_memory(cc.cache_memory, available)
        per_slot = sum(s.bytes_per_slot for s in info.cache_specs if isinstance(s, StateCacheSpec))
        num_ckpt = 0
        if cc.enable_prefix_caching and per_slot:
            num_ckpt = cc.num_checkpoint_slots if cc.num_checkpoint_slots is not None else (
                parse_memory(cc.checkpoint_memory, budget, "checkpoint_memory") // per_slot)
            logger.info("prefix cache: %d state checkpoint slots (%.1f MiB)", num_ckpt, num_ckpt * per_slot / 2**20)
        # Speculative steps keep the state after each proposed token in a scratch slot: k per running sequence. A
        # draft model's weights and caches come out of the same budget.
        max_num_seqs = self.config.scheduler.max_num_seqs
        num_scratch = max_num_seqs * proposer.num_speculative_tokens if proposer is not None else 0
        proposer_bytes = proposer.memory_bytes if proposer is not None else 0
        if proposer is not None:
            logger.info("speculative decoding: %d scratch state slots (%d per sequence, %.1f KiB each: %.1f MiB), "
                        "proposer %.1f MiB", num_scratch, proposer.num_speculative_tokens, per_slot / 2**10,
                        num_scratch * per_slot / 2**20, proposer_bytes / 2**20)
        reserved = (num_ckpt + num_scratch) * per_slot + proposer_bytes
        if info.decode_graphs:  # the padding rows' own slot and block, past the pools
            reserved += per_slot + sum(s.bytes_per_token for s in info.cache_specs
                                       if isinstance(s, KVCacheSpec)) * cc.block_size
        layout = plan_cache(
            info.cache_specs, budget_bytes=max(budget - reserved, 0), block_size=cc.block_size,
            max_num_seqs=max_num_seqs, num_blocks=cc.num_blocks, num_slots=cc.num_state_slots,
        )
        layout = self._plan_host_tier(layout, layout.total_bytes + reserved if info.device == "cpu" else 0)
        needed = layout.total_bytes + reserved
        # CPU ranks share this host's memory (each allocates its own cache); a GPU rank has its own device.
        sharing = self.config.parallel.world_size if info.device == "cpu" else 1
        if needed * sharing > available:  # checked before allocating: a cache larger than memory takes the host down
            ranks = f" x {sharing} ranks" if sharing > 1 else ""
            raise ValueError(f"the cache needs {needed / 2**30:.2f} GiB{ranks} (cache_memory={cc.cache_memory!r}, "
                             f"num_blocks={cc.num_blocks}, num_state_slots={cc.num_state_slots}) but only "
                             f"{available / 2**30:.2f} GiB are free on {info.device}")
        logger.info("per rank (%d rank(s)): weights %.1f MiB, %d KV blocks %.1f MiB, %d state slots %.1f MiB "
                    "(%d running, %d checkpoint, %d scratch; %.1f KiB each)", self.config.parallel.world_size,
                    info.weight_bytes / 2**20, layout.num_blocks, layout.num_blocks * layout.bytes_per_block / 2**20,
                    layout.num_slots + num_ckpt + num_scratch,
                    (layout.num_slots + num_ckpt + num_scratch) * per_slot / 2**20,
                    layout.num_slots, num_ckpt, num_scratch, per_slot / 2**10)
        self.executor.initialize_cache(layout, layout.num_slots + num_ckpt + num_scratch)
        self.cache = CacheManager(
            num_blocks=layout.num_blocks, num_slots=layout.num_slots, block_size=cc.block_size,
            num_checkpoint_slots=num_ckpt, bytes_per_slot=per_slot, enable_prefix_caching=cc.enable_prefix_caching,
            checkpoint_interval=cc.state_checkpoint_interval, num_scratch_slots=num_scratch,
            num_host_blocks=layout.num_host_blocks, num_host_slots=layout.num_host_slots,
            block_bytes=layout.bytes_per_block,
            shared=None if self.shared_store is None else RankZeroLookup(self.shared_store,
                                                                         self.config.parallel.world_size),
        )

    def _plan_host_tier(self, layout: CacheLayout, device_bytes_on_host: int) -> CacheLayout:
        """`layout` with the host tier's sizes from `host_cache_memory` (per rank; its checkpoint share is
        `checkpoint_memory`'s). `device_bytes_on_host`: what the device caches already take of host memory (CPU)."""
        cc = self.config.cache
        if cc.host_cache_memory is None or not cc.enable_prefix_caching:
            return layout
        free = available_host_bytes() - device_bytes_on_host * self.config.parallel.world_size
        budget = parse_memory(cc.host_cache_memory, free, "host_cache_memory")
        if budget * self.config.parallel.world_size > free:
            raise ValueError(f"host_cache_memory={cc.host_cache_memory!r} needs {budget / 2**30:.2f} GiB per rank "
                             f"but only {free / 2**30:.2f} GiB of host memory are free")
        slots = parse_memory(cc.checkpoint_memory, budget, "checkpoint_memory") // layout.bytes_per_slot
        blocks = (budget - slots * layout.bytes_per_slot) // layout.bytes_per_block
        if blocks < 1 or slots < 1:
            raise ValueError(f"host_cache_memory={cc.host_cache_memory!r} holds {blocks} KV block(s) and {slots} "
                             "state checkpoint(s): at least one of each is needed")
        logger.info("host tier (L2): %d KV blocks (%d tokens), %d state checkpoints, %.1f MiB per rank",
                    blocks, blocks * layout.block_size, slots,
                    (blocks * layout.bytes_per_block + slots * layout.bytes_per_slot) / 2**20)
        return dataclasses.replace(layout, num_host_blocks=int(blocks), num_host_slots=int(slots))

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self.executor.shutdown()
        if self.shared_store is not None:
            self.shared_store.close()

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until every grammar still compiling is ready (or `timeout_s` passes). For an offline batch: its
        constrained requests then join the first step with the others, so the batches, and with them every float
        of the results, do not depend on how fast a compile thread ran."""
        self.structured.wait(timeout_s, every=True)

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
                    eos_token_ids: frozenset[int] = frozenset(), priority: int = 0,
                    kv_transfer_params: dict[str, Any] | None = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a request (n must be 1 here: the frontend fans n out). ValueError on bad input.

        `images`: the prompt's preprocessed images, each over its run of placeholder tokens (a model without a
        vision tower refuses them).

        `kv_transfer_params` (prefill/decode disaggregation): `{"do_remote_decode": true}` on a prefill instance
        computes the prompt but its last token, publishes that cache and finishes (its last output carries the
        `kv_transfer_params` for the decode instance); a prefill instance's object on a decode instance fetches
        that cache before the request starts. An instance without the role computes the request itself."""
        if params.n != 1:
            raise ValueError("EngineCore.add_request takes n=1 sampling params; fan out n in the frontend")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        self.validate_prompt(prompt_token_ids)
        if images:
            if self.model_config.vision is None:
                raise ValueError("this model has no vision tower: it cannot take images")
            check_images(images, prompt_token_ids, self.model_config.vision.media_placeholder_token_id)
        vocab = self.model_config.vocab_size
        if params.allowed_token_ids is not None and not any(t < vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids has no token in the vocabulary [0, {vocab})")
        if self.structured.is_pending(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Transfer digests hash the image-aware tokens: two prompts differing only in an image never match.
        send, remote = self._transfer_role(request_id, keyed_tokens(prompt_token_ids, images), kv_transfer_params)
        if send is not None:  # the prefill side: the prompt but its last token, then one throwaway greedy token
            prompt_token_ids = prompt_token_ids[:send.num_tokens]
            params = SamplingParams(max_tokens=1, temperature=0.0)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, stop_token_ids=stops,
            arrival_index=next(self._arrivals), priority=priority, max_total_tokens=self.max_model_len,
            skip_prefix_cache=params.prompt_logprobs is not None,  # every prompt position must run the model
            kv_send=None if send is None else send.transfer_id, remote_prefill=remote,
            # A prefill-side request's prompt may end inside an image: the runner takes the rows it covers.
            images=tuple(i for i in images if i.offset < len(prompt_token_ids)),
        )
        if send is not None:
            self._sends[request_id] = send
        if params.structured is None:
            self.scheduler.add_request(request)
        else:  # compiled in a thread; queued in the scheduler by the first step() after it is ready
            self.scheduler.check_request(request)
            self.structured.submit(request)

    def _transfer_role(self, request_id: str, prompt: list[int], params: dict[str, Any] | None
                       ) -> tuple[RemotePrefill | None, RemotePrefill | None]:
        """(the transfer this prefill-side request publishes, the one this decode-side request fetches) from its
        `kv_transfer_params` and its `prompt` (image placeholders keyed by image); ValueError naming the field for a
        malformed object."""
        do_remote_decode, remote = parse_transfer_request(params)
        kv = self.config.kv_transfer_config
        if do_remote_decode:
            if kv is None or not kv.is_producer or len(prompt) < 2:  # computed here in full instead
                return None, None
            n = len(prompt) - 1
            return RemotePrefill(transfer_id=f"{self.engine_id}-{next(self._transfer_ids)}-{request_id}",
                                 addresses=self.transfer_addresses, num_tokens=n,
                                 prompt_digest=prompt_digest(prompt[:n])), None
        if remote is None:
            return None, None
        if kv is None or not kv.is_consumer or len(remote.addresses) != self.config.parallel.world_size or \
                remote.num_tokens != len(prompt) - 1 or remote.prompt_digest != prompt_digest(prompt[:-1]):
            logger.warning("request %s: kv_transfer_params do not fit this instance or prompt (%d rank(s), %d prompt "
                           "tokens; the transfer has %d rank(s), %d tokens): computing it here", request_id,
                           self.config.parallel.world_size, len(prompt), len(remote.addresses), remote.num_tokens)
            self.transfer.fallbacks += 1
            return None, None
        return None, remote

    def abort_request(self, request_id: str) -> None:
        """Cancel a request at any time; every block and slot it held is freed. Unknown ids are ignored."""
        self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request early with `reason` (a stop string found by the detokenizer); frees its grammar too."""
        if self.structured.cancel(request_id) is None:
            self.scheduler.finish_request(request_id, reason)
        self._prompt_logprobs.pop(request_id, None)
        self._sends.pop(request_id, None)
        self.grammar_hook.forget(request_id)
        if self.proposer_hook is not None:
            self.proposer_hook.forget(request_id)

    def fail_unfinished(self, error: str) -> list[EngineCoreOutput]:
        """After `step` raised: end every request the step held or the scheduler holds with `error` (one output
        each; the failed-compile outputs the step had already made come first), release the step's copy pins,
        drop the runner's per-request state and forget the prefix cache, since the failed step may have
        registered blocks and states it never finished writing. Requests still compiling a grammar stay."""
        made, held = self._in_step or ([], [])
        self._in_step = None
        ids = list(dict.fromkeys([*held, *self.scheduler.requests]))
        self.cache.end_step()
        for request_id in ids:  # the workers drop their sampling state with the next step's finished ids
            self.finish_request(request_id, FinishReason.ERROR)
        self.reset_prefix_cache()
        return made + [EngineCoreOutput(request_id=rid, new_token_ids=[], logprobs=[], finish_reason=FinishReason.ERROR,
                                        num_cached_tokens=0, error=error) for rid in ids]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, grammars compiling, or writes to the shared store queued for a step (the last request's
        blocks and final state: an idle engine would otherwise keep them from the other replicas until its next
        request, and lose them if it stopped)."""
        return self.scheduler.has_unfinished() or self.structured.num_pending > 0 or self.cache.has_pending_puts()

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached KV block and state checkpoint (running requests are unaffected).

        Returns (blocks uncached, checkpoints dropped)."""
        return self.cache.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        """A snapshot for metrics (named `get_stats` because `self.stats` holds the step timings)."""
        usage, prefix = self.cache.usage(), self.cache.prefix_stats()
        spec = next((h.stats for h in self.hooks if isinstance(h, ProposerHook)), SpecDecodeStats())
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=usage.num_blocks - usage.num_free_blocks, kv_blocks_total=usage.num_blocks,
            state_slots_used=usage.num_slots - usage.num_free_slots, state_slots_total=usage.num_slots,
            prefix_queried_tokens=prefix.queried_tokens, prefix_hit_tokens=prefix.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, steps=self.stats.steps,
            step_seconds=self.stats.total_seconds, forward_seconds=self.stats.forward_seconds,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens, spec_accepted_per_pos=tuple(spec.accepted_per_pos),
            **self._adaptive_stats(),
            host_hit_tokens=prefix.host_hit_tokens,
            host_demoted_bytes=(prefix.host_blocks_demoted * self.cache.block_bytes
                                + prefix.host_checkpoints_demoted * self.cache.bytes_per_slot),
            host_promoted_bytes=(prefix.host_blocks_promoted * self.cache.block_bytes
                                 + prefix.host_checkpoints_promoted * self.cache.bytes_per_slot),
            host_copy_seconds=self.stats.host_copy_seconds, shared_fetched=self.cache.shared_fetched,
            shared_fetch_failures=self.cache.shared_fetch_failures, **shared_store_stats(
                self.stats.shared_store, None if self.shared_store is None else self.shared_store.stats),
            kv_transfer_sent=self.transfer.sent, kv_transfer_sent_kv_bytes=self.transfer.sent_kv_bytes,
            kv_transfer_sent_state_bytes=self.transfer.sent_state_bytes, kv_transfer_received=self.cache.remote_fetched,
            kv_transfer_received_kv_bytes=self.transfer.received_kv_bytes,
            kv_transfer_received_state_bytes=self.transfer.received_state_bytes,
            kv_transfer_seconds=self.transfer.seconds, kv_transfer_failures=self.cache.remote_failures,
            kv_transfer_fallbacks=self.transfer.fallbacks + self.cache.remote_skipped,
            images_encoded=self.stats.images_encoded, encoder_cache_hits=self.stats.encoder_cache_hits,
            encoder_seconds=self.stats.encoder_seconds,
        )

    def _adaptive_stats(self) -> dict[str, int]:
        verifier = None if self.proposer_hook is None else self.proposer_hook.verifier
        if verifier is None:
            return {}
        s = verifier.stats
        return {"spec_adaptive_steps": s.num_steps, "spec_adaptive_offered_positions": s.num_offered_positions,
                "spec_adaptive_verified_positions": s.num_verified_positions,
                "spec_adaptive_draft_off_steps": s.num_draft_off_steps}

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration: hooks, schedule, run the model and the sampler on the workers, update every
        scheduled request.

        Requests whose grammar finished compiling join the scheduler first (a failed compile yields one output
        with FinishReason.ERROR); constrained sampling rows get their grammar's token bitmask; a proposer's tokens
        are verified in the step, so a request may gain several tokens at once.
        """
        if self.structured.num_pending and not self.scheduler.has_unfinished():
            self.structured.wait(IDLE_COMPILE_WAIT_S)  # nothing else to run: do not spin while grammars compile
        start = time.perf_counter()
        outputs = [out for hook in self.hooks for out in hook.before_schedule()]
        self._in_step = (list(outputs), list(self.scheduler.requests))  # what fail_unfinished reports if it raises
        out = self.scheduler.schedule()
        for hook in self.hooks:
            out = hook.after_schedule(out)
        result = self.executor.execute_model(out)
        for rid, entries in result.prompt_logprobs.items():  # held until the request's first token
            self._prompt_logprobs.setdefault(rid, []).extend(entries)
        events = self.scheduler.update_from_output(out, result)
        errors = {rid: error for hook in self.hooks for rid, error in hook.after_update(events, result).items()}
        elapsed = time.perf_counter() - start
        self.stats.steps += 1
        self.stats.total_seconds += elapsed
        self.stats.forward_seconds += result.forward_seconds
        self.stats.host_copy_seconds += result.host_copy_seconds
        if result.shared_store is not None:
            self.stats.shared_store = result.shared_store
        self.stats.images_encoded += result.encoder.images_encoded
        self.stats.encoder_cache_hits += result.encoder.cache_hits
        self.stats.encoder_seconds += result.encoder.seconds
        sent = self.transfer.add(result.transfer, self.config.parallel.world_size)
        if self.step_observer is not None:
            self.step_observer(out, elapsed)
        if self.proposer_hook is not None:
            self.proposer_hook.observe_step(out, elapsed)
        for e in events:
            error = errors.get(e.request.request_id)
            outputs.append(EngineCoreOutput(
                request_id=e.request.request_id, new_token_ids=[t.token_id for t in e.tokens],
                logprobs=[t.logprobs for t in e.tokens],
                finish_reason=e.finish_reason if error is None else FinishReason.ERROR,
                num_cached_tokens=e.request.num_cached_tokens or 0, error=error,
                prompt_logprobs=self._first_prompt_logprobs(e.request, len(e.tokens)),
                kv_transfer_params=self._sent_params(e.request.request_id, sent, e.finish_reason),
            ))
        self._in_step = None
        return outputs

    def _sent_params(self, request_id: str, sent: set[str], finish_reason: FinishReason | None
                     ) -> dict[str, Any] | None:
        """A finished prefill-side request's `kv_transfer_params`, if its cache was published in this step."""
        if finish_reason is None:
            return None
        send = self._sends.pop(request_id, None)
        return send.as_params() if send is not None and request_id in sent else None

    def _first_prompt_logprobs(self, request: Request, num_new: int) -> list[TokenLogprobs] | None:
        """The prompt logprobs for the output of a request's first tokens ([] for a one-token prompt, which has
        nothing to score); None on later outputs and for requests that did not ask."""
        if request.params.prompt_logprobs is None or len(request.output_token_ids) != num_new:
            return None
        return self._prompt_logprobs.pop(request.request_id, [])
