"""Turn a step's scheduled chunks into one flattened batch (decode rows first), run the model, sample."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.layers.forward_batch import ForwardBatch, KDALayerCache
from deltaserve.ops import sampling as sampling_ops
from deltaserve.runner.kv_tensors import allocate_layer_caches
from deltaserve.runner.sampler import SamplingRow, TokenBitmask, TokenLogprobs, sample
from deltaserve.scheduler.output import NewRequestData, RunnerOutput, SampledToken, ScheduledChunk, SchedulerOutput


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

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.model = model
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.device = next(model.parameters()).device
        self.caches = allocate_layer_caches(
            model.cache_specs(), num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, device=self.device
        )
        self._requests: dict[str, _RequestState] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.last_forward_seconds = 0.0
        """Wall time of the model forward (and LM head) in the last step: the rest of a step is overhead."""

    # -- the engine's entry point --------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step; returns a sampled token for every chunk with `sample` set."""
        self.last_forward_seconds = 0.0
        for rid in out.finished_request_ids:
            self._requests.pop(rid, None)
        for data in out.new_requests:
            seed = data.params.seed
            gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            self._requests[data.request_id] = _RequestState(data, gen)
        sampled: dict[str, SampledToken] = {}
        self._prompt_logprobs = {}
        self.apply_copies(out.block_copies, out.state_copies)
        if out.chunks:
            logits = self.execute_model(out.chunks, only_sampled=True)
            chunks = [c for c in out.chunks if c.sample]
            states = [self._requests[c.request_id] for c in chunks]
            rows = [
                SamplingRow(params=s.data.params, generator=s.generator, prompt_token_ids=s.data.prompt_token_ids,
                            output_token_ids=s.output_token_ids, stop_token_ids=s.data.stop_token_ids)
                for s in states
            ]
            if rows:
                result = sample(logits, rows, self._token_bitmask(out, chunks))
                for c, s, tok, lp in zip(chunks, states, result.token_ids, result.logprobs, strict=True):
                    s.output_token_ids.append(tok)
                    sampled[c.request_id] = SampledToken(tok, lp)
        return RunnerOutput(sampled=sampled, prompt_logprobs=self._prompt_logprobs,
                            forward_seconds=self.last_forward_seconds)

    def forget_requests(self) -> None:
        """Drop every request's sampling state (after a failed step ended them all)."""
        self._requests.clear()

    @staticmethod
    def _token_bitmask(out: SchedulerOutput, sampled: Sequence[ScheduledChunk]) -> TokenBitmask | None:
        """The grammar bitmask of the constrained rows among the `sampled` chunks (structured output), or None."""
        if not out.structured_request_ids:
            return None
        row = {c.request_id: i for i, c in enumerate(sampled)}
        return TokenBitmask(row_indices=[row[rid] for rid in out.structured_request_ids],
                            bitmask=out.grammar_bitmask)  # type: ignore[arg-type]

    # -- the model step ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, chunks: Sequence[ScheduledChunk], only_sampled: bool = False) -> torch.Tensor:
        """Forward pass; fp32 last-token logits [N, vocab] of each chunk in the order given (of the sampled chunks
        only, when `only_sampled`)."""
        for c in chunks:
            if c.reset_state:
                self.reset_slot(c.state_slot)
        ids, batch, order = self.build_batch(chunks)
        start = time.perf_counter()
        hidden = self.model(ids, batch, self.caches)
        last = batch.cu_seqlens[1:] - 1
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))  # original index -> row in the batch
        wanted = [i for i, c in enumerate(chunks) if c.sample or not only_sampled]
        rows = last[inverse[torch.tensor(wanted, dtype=torch.int64)].to(last.device)]
        logits = self.model.compute_logits(hidden[rows])
        if any(self._wants_prompt_logprobs(c.request_id) for c in chunks):
            self._collect_prompt_logprobs(chunks, hidden, batch.cu_seqlens_host, inverse.tolist())
        self.last_forward_seconds = time.perf_counter() - start
        return logits

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
                num_top = min(state.data.params.prompt_logprobs, logprobs.shape[1])
                top_ids, top_lp, token_lp, ranks = sampling_ops.gather_logprobs(logprobs, targets, num_top)
                for t, lp, rank, ids, values in zip(targets.tolist(), token_lp.tolist(), ranks.tolist(),
                                                    top_ids.tolist(), top_lp.tolist(), strict=True):
                    entries.append(TokenLogprobs(token_id=t, logprob=lp, rank=rank,
                                                 top=tuple(zip(ids, values, strict=True))))
            state.num_prompt_logprobs = end

    def build_batch(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Flatten `chunks` (decodes first). Returns input ids [T], the batch, and the order used."""
        is_decode = [c.is_decode for c in chunks]
        order = [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
        ordered = [chunks[i] for i in order]
        lens = torch.tensor([len(c.new_token_ids) for c in ordered], dtype=torch.int64)
        if (lens < 1).any():
            raise ValueError("every scheduled chunk needs at least one new token")
        computed = torch.tensor([c.num_computed_tokens for c in ordered], dtype=torch.int64)
        max_blocks = max(len(c.block_ids) for c in ordered)
        tables = torch.zeros(len(ordered), max_blocks, dtype=torch.int64)
        for row, c in enumerate(ordered):
            tables[row, : len(c.block_ids)] = torch.as_tensor(list(c.block_ids), dtype=torch.int64)
        seq_of_row = torch.repeat_interleave(torch.arange(len(ordered)), lens)
        cu = torch.zeros(len(ordered) + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        positions = computed[seq_of_row] + torch.arange(int(cu[-1])) - cu[:-1][seq_of_row]
        block = tables[seq_of_row, positions // self.block_size]
        slot_mapping = block * self.block_size + positions % self.block_size
        ids = torch.tensor([t for c in ordered for t in c.new_token_ids], dtype=torch.int64)
        dev = self.device
        num_decodes = sum(is_decode)
        prefills = ordered[num_decodes:]
        saving = any(c.checkpoints for c in prefills)
        decode_slots = [c.state_slot for c in ordered[:num_decodes]]
        consecutive = decode_slots and decode_slots == list(range(decode_slots[0], decode_slots[0] + num_decodes))
        batch = ForwardBatch(
            cu_seqlens=cu.to(dev),
            cu_seqlens_host=tuple(cu.tolist()),
            context_lens=(computed + lens).to(dev),
            num_decodes=num_decodes,
            decode_slot_range=slice(decode_slots[0], decode_slots[0] + num_decodes) if consecutive else None,
            state_indices=torch.tensor([c.state_slot for c in ordered], dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=slot_mapping.to(dev),
            checkpoint_positions=tuple(tuple(p for p, _ in c.checkpoints) for c in prefills) if saving else None,
            checkpoint_slots=tuple(tuple(s for _, s in c.checkpoints) for c in prefills) if saving else None,
        )
        return ids.to(dev), batch, order

    def apply_copies(
        self, block_copies: Sequence[tuple[int, int, int]], state_copies: Sequence[tuple[int, int]]
    ) -> None:
        """Copy cached partial KV blocks and checkpoint states into the blocks and slots of requests that hit them."""
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                for src, dst in state_copies:
                    cache.state[dst].copy_(cache.state[src])
                    cache.conv[dst].copy_(cache.conv[src])
            else:
                for src, dst, rows in block_copies:
                    cache.kv[dst, :rows].copy_(cache.kv[src, :rows])

    def reset_slot(self, slot: int) -> None:
        """Zero a KDA state slot (recurrent state and conv window) in every KDA layer."""
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                cache.state[slot].zero_()
                cache.conv[slot].zero_()
