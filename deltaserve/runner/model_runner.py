"""Turn a list of scheduled chunks into one flattened batch (decode rows first), run the model, return logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.layers.forward_batch import ForwardBatch, KDALayerCache
from deltaserve.runner.kv_tensors import allocate_layer_caches


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """The tokens of one sequence to compute in this step and where its cache lives."""

    new_token_ids: Sequence[int]
    num_computed_tokens: int
    """Tokens of this sequence already in the cache (the new ones follow them)."""
    state_slot: int
    block_ids: Sequence[int]
    """KV blocks covering at least num_computed_tokens + len(new_token_ids) tokens."""
    reset_state: bool = False
    """Zero the KDA state slot before computing (a sequence starting from scratch)."""


class ModelRunner:
    """Owns the model and its cache tensors; `execute` runs one step over any mix of prefill and decode chunks."""

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.model = model
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        device = next(model.parameters()).device
        self.device = device
        self.caches = allocate_layer_caches(
            model.cache_specs(), num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, device=device
        )

    def build_batch(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Flatten `chunks` (decodes first). Returns input ids [T], the batch, and the order used."""
        is_decode = [len(c.new_token_ids) == 1 and c.num_computed_tokens > 0 for c in chunks]
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
        batch = ForwardBatch(
            cu_seqlens=cu.to(dev),
            context_lens=(computed + lens).to(dev),
            num_decodes=sum(is_decode),
            state_indices=torch.tensor([c.state_slot for c in ordered], dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=slot_mapping.to(dev),
        )
        return ids.to(dev), batch, order

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step; returns fp32 logits [N, vocab] of each chunk's last token, in the order given."""
        for c in chunks:
            if c.reset_state:
                self.reset_slot(c.state_slot)
        ids, batch, order = self.build_batch(chunks)
        hidden = self.model(ids, batch, self.caches)
        logits = self.model.compute_logits(hidden[batch.cu_seqlens[1:] - 1])
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=logits.device)] = logits
        return out

    def reset_slot(self, slot: int) -> None:
        """Zero a KDA state slot (recurrent state and conv window) in every KDA layer."""
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                cache.state[slot].zero_()
                cache.conv[slot].zero_()
