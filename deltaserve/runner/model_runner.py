"""Turn a step's scheduled chunks into one flattened batch (decode rows first), run the model, sample."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.cache.remote import TransferResult
from deltaserve.layers.forward_batch import KDALayerCache, LayerCache
from deltaserve.models.protocol import Model
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.ops import sampling as sampling_ops
from deltaserve.outputs import TokenLogprobs
from deltaserve.runner.block_drafting import BlockDrafting, StepLayout
from deltaserve.runner.cuda_graphs import DecodeGraphs, GraphSettings
from deltaserve.runner.host_cache import HostCache, HostCopyJob
from deltaserve.runner.image_embedder import ImageEmbedder
from deltaserve.runner.input_batch import InputBatch
from deltaserve.runner.kv_tensors import allocate_layer_caches
from deltaserve.runner.kv_transfer_io import KVTransferIO
from deltaserve.runner.sampler import DraftToken, SamplingRow, TokenBitmask, sample, sampling_probs, token_logprobs
from deltaserve.runner.shared_io import SharedStoreIO
from deltaserve.runner.staged_caches import StagedCaches
from deltaserve.scheduler.output import (
    BlockDraft,
    EncoderStepStats,
    NewRequestData,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)


@dataclass(slots=True)
class _RequestState:
    """What the runner keeps per live request for sampling."""

    data: NewRequestData
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0
    """Prompt positions whose logprobs were already computed (a recompute after preemption does not repeat them)."""


class ModelRunner:
    """Owns the model and its cache tensors; `execute` runs one step over any mix of prefill and decode chunks."""

    def __init__(self, model: Model, *, num_blocks: int, block_size: int, num_slots: int,
                 max_num_tokens: int = 2048, num_host_blocks: int = 0, num_host_slots: int = 0,
                 overlap_host_copies: bool | None = None, rejection_sample_method: str = "standard",
                 graphs: GraphSettings | None = None) -> None:
        """`num_host_blocks`, `num_host_slots`: the host tier of the prefix cache (none when 0);
        `overlap_host_copies`: its copies run beside the forward, layer by layer (False: all before it; None: beside
        it on a GPU, before it on a CPU); `graphs`: pure-decode steps padded to these sizes on static buffers
        (`runner.cuda_graphs`), captured as CUDA graphs by `capture_graphs` where the settings say so."""
        self.model = model
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.device = next(model.parameters()).device
        pad = 1 if graphs is not None else 0  # the padding rows' own block and slot, past the pools'
        self.caches = allocate_layer_caches(
            model.cache_specs(), num_blocks=num_blocks + pad, block_size=block_size, num_slots=num_slots + pad,
            device=self.device,
        )
        self.graphs = None if graphs is None else DecodeGraphs(
            model, self.caches, sizes=graphs.sizes, max_blocks=graphs.max_blocks, block_size=block_size,
            pad_block=num_blocks, pad_slot=num_slots, device=self.device)
        """Decode steps at padded sizes: CUDA graph replays once captured, else the padded eager twin."""
        self.host = HostCache(model.cache_specs(), num_blocks=num_host_blocks, num_slots=num_host_slots,
                              block_size=block_size, device=self.device,
                              overlap=overlap_host_copies) if num_host_blocks else None
        self.shared: SharedStoreIO | None = None
        """The shared store's reader and writer (set by the worker when a store is configured)."""
        self.transfer: KVTransferIO | None = None
        """Disaggregation: publishes prefill caches and fetches remote ones (set by the worker when configured)."""
        self.images: ImageEmbedder | None = None
        """The vision tower and encoder cache (set by the worker when the checkpoint has a vision tower)."""
        self.drafting: BlockDrafting | None = None
        """Speculative method dspark: the block drafter, run after sampling (set by the worker)."""
        self._layout = StepLayout((), ())
        """Where the last forward put each chunk's rows (the block drafter reads its features by it)."""
        self.input_batch = InputBatch(block_size=block_size, device=self.device, max_num_tokens=max_num_tokens)
        self._requests: dict[str, _RequestState] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.last_forward_seconds = 0.0
        """Wall time of the model forward (and LM head) in the last step: the rest of a step is overhead."""
        if rejection_sample_method not in ("standard", "block"):
            raise ValueError(f"rejection_sample_method must be 'standard' or 'block', got {rejection_sample_method!r}")
        self.rejection_sample_method = rejection_sample_method
        """How proposals with draft distributions are verified: 'standard' (token by token) or 'block' (jointly,
        `ops.sampling.block_rejection_sample`)."""

    def capture_graphs(self, agree: Callable[[bool], bool] = lambda ok: ok) -> None:
        """Warm up and capture the decode graphs (a GPU). `agree(ok)`: whether every rank's warm-up succeeded, so
        that all ranks capture or none (their graphs hold the collectives). On any failure (logged) the steps stay
        eager."""
        if self.graphs is None:
            return
        if not (agree(self.graphs.warm_up()) and self.graphs.capture()):
            self.graphs = None

    # -- the engine's entry point --------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step; returns the tokens of every chunk with `sample` set (with proposed tokens: the
        accepted ones, then one sampled token)."""
        self.last_forward_seconds = 0.0
        for rid in out.finished_request_ids:
            self._requests.pop(rid, None)
            if self.drafting is not None:
                self.drafting.forget(rid)
        for data in out.new_requests:
            seed = data.params.seed
            gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            self._requests[data.request_id] = _RequestState(data, gen)
        sampled: dict[str, list[SampledToken]] = {}
        drafts: dict[str, BlockDraft] = {}
        self._prompt_logprobs = {}
        fetched: list[bool] = []
        host_caches = None if self.host is None else self.host.caches
        store_reads = None
        if out.shared_ops is not None:  # first: puts read what the last step registered, before anything writes
            if self.shared is None:
                fetched = [False] * len(out.shared_ops.fetches)
            else:  # fetches read during the step, written after it into host entries this step does not touch
                store_reads = self.shared.start(out.shared_ops, self.caches, host_caches)
        transfer = pending = None
        if out.remote_fetches:  # downloads during the step, written after it into entries this step does not touch
            if self.transfer is None:
                transfer = TransferResult(fetched=[False] * len(out.remote_fetches))
            else:
                pending = self.transfer.start_fetch(out.remote_fetches, self.caches, host_caches)
        staged = self._stage(out)
        try:  # the host-tier copies overlap the forward; every copy is done when this returns, even if it raised
            logits = self.execute_model(out.chunks, only_sampled=True, caches=staged) if out.chunks else None
        finally:
            host_seconds = staged.finish()
        if logits is not None:
            sends = [c for c in out.chunks if c.kv_send is not None]
            if sends:
                if self.transfer is None:
                    raise RuntimeError("a prefill cache to publish, but this runner has no kv transfer configured")
                start = time.perf_counter()
                sent = self.transfer.publish(sends, self.caches)
                transfer = dataclasses.replace(transfer or TransferResult(), sent=sent, seconds=(
                    transfer.seconds if transfer else 0.0) + time.perf_counter() - start)
            chunks = [c for c in out.chunks if c.sample]
            if chunks:
                sampled = self._sample(logits, chunks, out if self.drafting is None
                                       else self.drafting.with_kept_probs(out))
            if self.drafting is not None:
                only = out.draft_only
                params = {c.request_id: self._requests[c.request_id].data.params for c in chunks
                          if only is None or c.request_id in only} if out.propose_drafts else {}
                drafts = self.drafting.after_step(out.chunks, sampled, self._layout, params,
                                                  propose=out.propose_drafts, only=only)
        if store_reads is not None:
            assert self.shared is not None
            fetched = self.shared.finish(store_reads)
        if pending is not None:
            assert self.transfer is not None
            fetched_now = self.transfer.finish_fetch(pending, self.caches, host_caches)
            transfer = fetched_now if transfer is None else dataclasses.replace(
                fetched_now, sent=transfer.sent, seconds=fetched_now.seconds + transfer.seconds)
        return RunnerOutput(sampled=sampled, prompt_logprobs=self._prompt_logprobs, drafts=drafts,
                            forward_seconds=self.last_forward_seconds, host_copy_seconds=host_seconds,
                            shared_fetched=fetched, transfer=transfer,
                            shared_store=None if self.shared is None else self.shared.store.stats,
                            encoder=EncoderStepStats() if self.images is None else self.images.take_step_stats())

    def _stage(self, out: SchedulerOutput) -> StagedCaches:
        """The caches this step's forward sees: the host-tier copies started (layer by layer, beside the forward),
        then per layer the step's device copies and state resets (`StagedCaches`)."""
        job = HostCopyJob()
        if out.host_copies is not None:
            if self.host is None:
                raise RuntimeError("host-tier copies scheduled, but this runner has no host tier")
            job = self.host.start(out.host_copies, self.caches)
        resets = [c.state_slot for c in out.chunks if c.reset_state]

        def prepare(cache: LayerCache) -> None:
            _apply_layer_copies(cache, out.block_copies, out.state_copies)
            if resets and isinstance(cache, KDALayerCache):
                _zero_slots(cache, resets)
        return StagedCaches(self.caches, job, prepare)

    def _sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], out: SchedulerOutput
                ) -> dict[str, list[SampledToken]]:
        """Sample every chunk's next token; for chunks with proposed tokens, verify them position by position.

        `logits` has 1 + num_proposed rows per chunk, in chunk order. Round j samples position j of every chunk
        whose proposals 1..j were all accepted, with the penalties, bad words, min_tokens and grammar mask of that
        position (given the tokens accepted before it). A proposal drawn from a known distribution
        (`out.draft_probs`) is verified by rejection sampling; a deterministic one (n-gram, greedy draft) by
        sampling as plain decoding would and accepting it when the sample equals it, which is rejection sampling
        for a one-hot draft and keeps greedy and seeded outputs exactly those of plain decoding. The first
        rejected position keeps its sample; when all are accepted, the position after them is sampled too. With
        `rejection_sample_method` 'block', chunks whose proposals have draft distributions are verified jointly
        instead (`_verify_blocks`); the others take the rounds in the same call."""
        states = [self._requests[c.request_id] for c in chunks]
        first_row = list(itertools.accumulate((1 + c.num_proposed for c in chunks), initial=0))
        mask_row = {}  # request id -> its first row in the grammar bitmask
        if out.grammar_bitmask is not None:
            proposed = {c.request_id: c.num_proposed for c in chunks}
            mask_row = dict(zip(out.structured_request_ids, itertools.accumulate(
                (1 + proposed[rid] for rid in out.structured_request_ids), initial=0), strict=False))
        result: dict[str, list[SampledToken]] = {c.request_id: [] for c in chunks}
        blocks = [i for i, c in enumerate(chunks) if c.num_proposed and c.request_id in out.draft_probs
                  ] if self.rejection_sample_method == "block" else []
        if blocks:
            self._verify_blocks(logits, chunks, blocks, first_row, mask_row, out, result)
        if not out.draft_probs and not mask_row and all(_plain_greedy(s) for s in states):
            # Nothing changes these rows' logits before the argmax: one argmax for every position, the same tokens
            # the rounds below would pick, without a sampler call per position.
            picked = logits.argmax(dim=-1).tolist()
            for i, (c, state) in enumerate(zip(chunks, states, strict=True)):
                for j in range(1 + c.num_proposed):
                    token = picked[first_row[i] + j]
                    state.output_token_ids.append(token)
                    result[c.request_id].append(SampledToken(token))
                    if j == c.num_proposed or token != c.new_token_ids[1 + j]:
                        break
            return result
        done = set(blocks)
        active = [i for i in range(len(chunks)) if i not in done]
        if not active:
            return result
        for j in range(1 + max(c.num_proposed for c in chunks)):
            rows = [SamplingRow(params=states[i].data.params, generator=states[i].generator,
                                prompt_token_ids=states[i].data.prompt_token_ids,
                                output_token_ids=states[i].output_token_ids,
                                stop_token_ids=states[i].data.stop_token_ids) for i in active]
            step_logits = logits if len(first_row) - 1 == logits.shape[0] else logits[
                torch.tensor([first_row[i] + j for i in active], device=logits.device)]
            constrained = [(n, mask_row[chunks[i].request_id] + j) for n, i in enumerate(active)
                           if chunks[i].request_id in mask_row]
            bitmask = None if not constrained or out.grammar_bitmask is None else TokenBitmask(
                row_indices=[n for n, _ in constrained],
                bitmask=out.grammar_bitmask[torch.tensor([r for _, r in constrained])])
            drafts = [self._draft(chunks[i], j, out.draft_probs) for i in active] if out.draft_probs else None
            sampled = sample(step_logits, rows, bitmask, drafts)
            still = []
            for i, tok, lp in zip(active, sampled.token_ids, sampled.logprobs, strict=True):
                states[i].output_token_ids.append(tok)
                result[chunks[i].request_id].append(SampledToken(tok, lp))
                if j < chunks[i].num_proposed and tok == chunks[i].new_token_ids[1 + j]:
                    still.append(i)
            if not still:
                break
            active = still
        return result

    def _verify_blocks(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], blocks: Sequence[int],
                       first_row: Sequence[int], mask_row: dict[str, int], out: SchedulerOutput,
                       result: dict[str, list[SampledToken]]) -> None:
        """Block verification (`ops.sampling.block_rejection_sample`) of the chunks at `blocks`, whose proposals
        were drawn from `out.draft_probs`. One sampler pass gives the target distribution at every position 0..n of
        each, given the proposals before it (penalties, bad words and min_tokens count them as output tokens; each
        position has its own grammar mask row); then each request's accepted proposals and the token after them
        join its output and `result`, with logprobs of their raw logits rows where asked."""
        rows: list[SamplingRow] = []
        logit_rows: list[int] = []
        constrained: list[tuple[int, int]] = []  # (row, grammar bitmask row)
        for i in blocks:
            c, state = chunks[i], self._requests[chunks[i].request_id]
            proposed = c.new_token_ids[len(c.new_token_ids) - c.num_proposed:]
            for j in range(1 + c.num_proposed):
                if c.request_id in mask_row:
                    constrained.append((len(rows), mask_row[c.request_id] + j))
                rows.append(SamplingRow(params=state.data.params, generator=state.generator,
                                        prompt_token_ids=state.data.prompt_token_ids,
                                        output_token_ids=[*state.output_token_ids, *proposed[:j]],
                                        stop_token_ids=state.data.stop_token_ids))
                logit_rows.append(first_row[i] + j)
        bitmask = None if not constrained or out.grammar_bitmask is None else TokenBitmask(
            row_indices=[n for n, _ in constrained],
            bitmask=out.grammar_bitmask[torch.tensor([r for _, r in constrained])])
        block_logits = logits[torch.tensor(logit_rows, device=logits.device)]  # [R, V]
        probs = sampling_probs(block_logits, rows, bitmask)  # [R, V]
        emitted: list[tuple[str, int, int]] = []  # (request id, row in `rows`, token)
        start = 0
        for i in blocks:
            c, state = chunks[i], self._requests[chunks[i].request_id]
            proposed = c.new_token_ids[len(c.new_token_ids) - c.num_proposed:]
            num_accepted, token = sampling_ops.block_rejection_sample(
                probs[start:start + c.num_proposed + 1], out.draft_probs[c.request_id][:c.num_proposed],
                torch.tensor(proposed, device=probs.device), state.generator)
            tokens = [*proposed[:num_accepted], token]
            state.output_token_ids.extend(tokens)
            emitted.extend((c.request_id, start + j, t) for j, t in enumerate(tokens))
            start += c.num_proposed + 1
        logprobs: list[TokenLogprobs | None] = [None] * len(emitted)
        if any(rows[r].params.logprobs is not None for _, r, _ in emitted):
            picked = [r for _, r, _ in emitted]
            logprobs = token_logprobs(block_logits[torch.tensor(picked, device=logits.device)],
                                      torch.tensor([t for _, _, t in emitted], device=logits.device),
                                      [rows[r] for r in picked])
        for (rid, _, t), lp in zip(emitted, logprobs, strict=True):
            result[rid].append(SampledToken(t, lp))

    @staticmethod
    def _draft(chunk: ScheduledChunk, position: int, draft_probs: dict[str, torch.Tensor]) -> DraftToken | None:
        """The proposal a chunk verifies at `position`, with its draft distribution, if it was drawn from one."""
        probs = draft_probs.get(chunk.request_id)
        if probs is None or position >= chunk.num_proposed:
            return None
        return DraftToken(chunk.new_token_ids[1 + position], probs[position])

    # -- the model step ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, chunks: Sequence[ScheduledChunk], only_sampled: bool = False,
                      caches: Sequence[LayerCache] | None = None) -> torch.Tensor:
        """Forward pass; fp32 logits [N, vocab], in the order of `chunks`: the last position of each chunk (of the
        sampled chunks only, when `only_sampled`), and for a sampled chunk with proposed tokens its last
        1 + num_proposed positions. `caches`: the caches as the forward sees them, with the chunks' state resets
        already arranged (`execute`'s staged view); None: this runner's, after zeroing the slots to reset."""
        if caches is None:
            for c in chunks:
                if c.reset_state:
                    self.reset_slot(c.state_slot)
            caches = self.caches
        ids, batch, order = self.input_batch.build(chunks)
        start = time.perf_counter()
        if self.images is not None:
            placed = self.images.embeds([chunks[i] for i in order], batch.cu_seqlens_host, self._images_of)
            if placed is not None:
                batch = dataclasses.replace(batch, embed_rows=placed[0], embed_values=placed[1])
        # A pure-decode step without image features or prompt logprobs: a graph replay (or its padded twin).
        if (self.graphs is not None and batch.embed_rows is None and batch.num_decodes == len(chunks)
                and all(c.sample for c in chunks) and not any(self._wants_prompt_logprobs(c.request_id)
                                                              for c in chunks)):
            logits = self.graphs.step(ids, batch, caches)
            if logits is not None:  # decode rows only: the batch is in chunk order, one row each
                self._layout = StepLayout(batch.cu_seqlens_host, list(range(len(chunks))))
                self.last_forward_seconds = time.perf_counter() - start
                return logits
        hidden = self.model(ids, batch, caches)
        row_of_chunk = [0] * len(order)  # original index -> sequence row in the batch
        for row, i in enumerate(order):
            row_of_chunk[i] = row
        cu = batch.cu_seqlens_host
        self._layout = StepLayout(cu, row_of_chunk)
        rows: list[int] = []
        for i, c in enumerate(chunks):
            if c.sample or not only_sampled:
                end = cu[row_of_chunk[i] + 1]
                rows.extend(range(end - 1 - (c.num_proposed if c.sample else 0), end))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        if any(self._wants_prompt_logprobs(c.request_id) for c in chunks):
            self._collect_prompt_logprobs(chunks, hidden, cu, row_of_chunk)
        self.last_forward_seconds = time.perf_counter() - start
        return logits

    def _images_of(self, request_id: str) -> tuple[ImageInput, ...]:
        state = self._requests.get(request_id)
        return () if state is None else state.data.images

    def _wants_prompt_logprobs(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and state.data.params.prompt_logprobs is not None

    PROMPT_LOGPROB_ROWS = 256
    """Prompt positions per LM-head slice: [rows, vocab] fp32 logits stay small for a large vocabulary."""

    def _collect_prompt_logprobs(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor,
                                 cu_seqlens: Sequence[int], row_of_chunk: Sequence[int]) -> None:
        """For chunks of requests with prompt_logprobs: the logprob (rank, top alternatives) of prompt token p + 1
        at each computed position p not collected before, into `self._prompt_logprobs`."""
        for i, c in enumerate(chunks):
            if not self._wants_prompt_logprobs(c.request_id):
                continue
            state = self._requests[c.request_id]
            prompt = state.data.prompt_token_ids
            first = max(c.num_computed_tokens, state.num_prompt_logprobs)
            end = min(c.num_computed_tokens + len(c.new_token_ids), len(prompt) - 1)
            if first >= end:
                continue
            start_row = cu_seqlens[row_of_chunk[i]] - c.num_computed_tokens
            entries = self._prompt_logprobs.setdefault(c.request_id, [])
            for lo in range(first, end, self.PROMPT_LOGPROB_ROWS):
                hi = min(lo + self.PROMPT_LOGPROB_ROWS, end)
                logprobs = sampling_ops.compute_logprobs(self.model.compute_logits(
                    hidden[start_row + lo:start_row + hi]))  # [n, V]
                targets = torch.tensor(prompt[lo + 1:hi + 1], device=logprobs.device)
                num_top = min(state.data.params.prompt_logprobs or 0, logprobs.shape[1])
                top_ids, top_lp, token_lp, ranks = sampling_ops.gather_logprobs(logprobs, targets, num_top)
                for t, lp, rank, ids, values in zip(targets.tolist(), token_lp.tolist(), ranks.tolist(),
                                                    top_ids.tolist(), top_lp.tolist(), strict=True):
                    entries.append(TokenLogprobs(token_id=t, logprob=lp, rank=rank,
                                                 top=tuple(zip(ids, values, strict=True))))
            state.num_prompt_logprobs = end

    def time_step(self, num_seqs: int, query_len: int, context_len: int) -> float:
        """Seconds of one forward (and LM head on every verified row) of `num_seqs` sequences of `query_len` new
        tokens after `context_len` cached ones, as a speculative step (query_len - 1 proposals). For the adaptive
        verifier's cost model at start-up, before any request: it writes into state slots [0, num_seqs) and into
        the first blocks (shared by every sequence: their contents do not matter, only the work)."""
        num_blocks = -(-(context_len + query_len) // self.block_size)
        if num_seqs > self.num_slots or num_blocks > self.num_blocks:
            raise ValueError(f"time_step: {num_seqs} sequences of {context_len + query_len} tokens need {num_seqs} "
                             f"slots and {num_blocks} blocks, the cache has {self.num_slots} and {self.num_blocks}")
        chunks = [ScheduledChunk(request_id=f"timing-{s}", new_token_ids=[0] * query_len,
                                 num_computed_tokens=context_len, state_slot=s, block_ids=list(range(num_blocks)),
                                 num_proposed=query_len - 1) for s in range(num_seqs)]
        start = time.perf_counter()
        self.execute_model(chunks, only_sampled=True).argmax(dim=-1).tolist()  # .tolist waits for the device
        seconds = time.perf_counter() - start
        if self.drafting is not None:
            self.drafting.taps.take()  # not a real step's features
        return seconds

    def apply_copies(
        self, block_copies: Sequence[tuple[int, int, int]], state_copies: Sequence[tuple[int, int]]
    ) -> None:
        """Copy cached partial KV blocks and checkpoint states into the blocks and slots of requests that hit them."""
        for cache in self.caches:
            _apply_layer_copies(cache, block_copies, state_copies)

    def reset_slot(self, slot: int) -> None:
        """Zero a KDA state slot (recurrent state and conv window) in every KDA layer."""
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                _zero_slots(cache, [slot])


def _apply_layer_copies(cache: LayerCache, block_copies: Sequence[tuple[int, int, int]],
                        state_copies: Sequence[tuple[int, int]]) -> None:
    """One layer's part of `ModelRunner.apply_copies`."""
    if isinstance(cache, KDALayerCache):
        for src, dst in state_copies:
            cache.state[dst].copy_(cache.state[src])
            cache.conv[dst].copy_(cache.conv[src])
    else:
        for src, dst, rows in block_copies:
            cache.kv[dst, :rows].copy_(cache.kv[src, :rows])


def _zero_slots(cache: KDALayerCache, slots: Sequence[int]) -> None:
    for slot in slots:
        cache.state[slot].zero_()
        cache.conv[slot].zero_()


def _plain_greedy(state: _RequestState) -> bool:
    """The sampler would take the argmax of this request's raw logits: greedy, no logprobs, and no mask, bias or
    penalty that could change them (min_tokens already reached)."""
    params = state.data.params
    return (params.greedy and params.logprobs is None and not params.has_penalties
            and params.allowed_token_ids is None and not params.bad_words_token_ids and not params.logit_bias
            and len(state.output_token_ids) >= params.min_tokens)
