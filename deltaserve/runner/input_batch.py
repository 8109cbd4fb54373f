"""`InputBatch`: the per-step input tensors written into persistent host buffers instead of allocated each step.

Each buffer grows (doubling) the first time a step needs more and is reused afterwards, so a steady state allocates
no input tensors; on a CPU the tensors handed to the model are views of these buffers (no copy), on a GPU one copy
each. CUDA graphs will need fixed addresses for the same tensors; this is where they will live.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deltaserve.cache.block_pool import BlockList
from deltaserve.layers.forward_batch import ForwardBatch
from deltaserve.scheduler.output import ScheduledChunk


class InputBatch:
    """Builds one step's flattened varlen batch (decode rows, then verify chunks, then prefill chunks) in reused int64
    host buffers."""

    def __init__(self, *, block_size: int, device: torch.device, max_num_tokens: int = 2048,
                 max_num_seqs: int = 64) -> None:
        self.block_size, self.device = block_size, device
        self._tensors: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._rows = _BlockRows()
        for name, size in (("ids", max_num_tokens), ("slot_mapping", max_num_tokens), ("cu", max_num_seqs + 1),
                           ("context_lens", max_num_seqs), ("state_indices", max_num_seqs),
                           ("block_tables", max_num_seqs * 64)):
            self._grow(name, size)

    def build(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Flatten `chunks` (decodes, verifies, prefills). Returns input ids [T], the batch, and the order used (batch
        row i is `chunks[order[i]]`)."""
        group = [0 if c.is_decode else 1 if c.num_proposed else 2 for c in chunks]  # decode, verify, prefill
        order = sorted(range(len(chunks)), key=group.__getitem__)  # stable: chunk order within a group
        ordered = [chunks[i] for i in order]
        n = len(ordered)
        lens = np.fromiter((len(c.new_token_ids) for c in ordered), dtype=np.int64, count=n)
        if (lens < 1).any():
            raise ValueError("every scheduled chunk needs at least one new token")
        total = int(lens.sum())
        computed = np.fromiter((c.num_computed_tokens for c in ordered), dtype=np.int64, count=n)
        max_blocks = max(len(c.block_ids) for c in ordered)

        ids = self._array("ids", total)
        ids[:] = [t for c in ordered for t in c.new_token_ids]
        cu = self._array("cu", n + 1)
        cu[0] = 0
        np.cumsum(lens, out=cu[1:])
        context_lens = self._array("context_lens", n)
        np.add(computed, lens, out=context_lens)
        state_indices = self._array("state_indices", n)
        state_indices[:] = [c.state_slot for c in ordered]
        tables = self._array("block_tables", n * max_blocks).reshape(n, max_blocks)
        for row, c in enumerate(ordered):
            ids = self._rows.get(c.request_id, c.block_ids)
            tables[row, : len(ids)] = ids
            tables[row, len(ids) :] = 0
        self._rows.retain({c.request_id for c in ordered})
        seq_of_row = np.repeat(np.arange(n), lens)
        positions = computed[seq_of_row] + np.arange(total) - cu[:-1][seq_of_row]
        slot_mapping = self._array("slot_mapping", total)
        np.add(tables[seq_of_row, positions // self.block_size] * self.block_size, positions % self.block_size,
               out=slot_mapping)

        num_decodes, num_verifies = group.count(0), group.count(1)
        verifies = ordered[num_decodes:num_decodes + num_verifies]
        prefills = ordered[num_decodes + num_verifies:]
        verify_rows = verify_context = None
        if verifies:
            first, last = int(cu[num_decodes]), int(cu[num_decodes + num_verifies])
            verify_rows = torch.from_numpy(seq_of_row[first:last].copy()).to(self.device)
            verify_context = torch.from_numpy(positions[first:last] + 1).to(self.device)
        saving = any(c.checkpoints for c in prefills)
        decode_slots = state_indices[:num_decodes].tolist()
        consecutive = decode_slots and decode_slots == list(range(decode_slots[0], decode_slots[0] + num_decodes))
        batch = ForwardBatch(
            cu_seqlens=self._tensor("cu", n + 1),
            cu_seqlens_host=tuple(cu.tolist()),
            context_lens=self._tensor("context_lens", n),
            context_lens_host=tuple(context_lens.tolist()),
            num_decodes=num_decodes,
            num_verifies=num_verifies,
            verify_scratch_slots=tuple(tuple(slot for _, slot in sorted(c.checkpoints)) for c in verifies),
            verify_rows=verify_rows,
            verify_context_lens=verify_context,
            decode_slot_range=slice(decode_slots[0], decode_slots[0] + num_decodes) if consecutive else None,
            state_indices=self._tensor("state_indices", n),
            block_tables=self._tensor("block_tables", n * max_blocks).view(n, max_blocks),
            slot_mapping=self._tensor("slot_mapping", total),
            checkpoint_positions=tuple(tuple(p for p, _ in c.checkpoints) for c in prefills) if saving else None,
            checkpoint_slots=tuple(tuple(s for _, s in c.checkpoints) for c in prefills) if saving else None,
        )
        return self._tensor("ids", total), batch, order

    def _array(self, name: str, size: int) -> np.ndarray:
        """The first `size` entries of a buffer, as a numpy view to fill."""
        if size > len(self._arrays[name]):
            self._grow(name, max(size, 2 * len(self._arrays[name])))
        return self._arrays[name][:size]

    def _tensor(self, name: str, size: int) -> torch.Tensor:
        """The first `size` entries of a buffer as a tensor on the model's device (a view on a CPU)."""
        return self._tensors[name][:size].to(self.device)

    def _grow(self, name: str, size: int) -> None:
        tensor = torch.zeros(size, dtype=torch.int64)
        self._tensors[name], self._arrays[name] = tensor, tensor.numpy()


class _BlockRows:
    """Each request's block ids mirrored as an int64 array, updated from a `BlockList` by the ids appended since the
    last step when its epoch is unchanged (a long context's table then costs a memcpy per step, not a conversion of
    its whole Python list); any other list is converted whole."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, np.ndarray, int]] = {}  # request id -> (epoch, buffer, ids mirrored)

    def get(self, request_id: str, ids: list[int]) -> np.ndarray:
        """The ids as an int64 array (a view of the mirror; valid until the next call for this request)."""
        if not isinstance(ids, BlockList):
            return np.asarray(ids, dtype=np.int64)
        n = len(ids)
        entry = self._rows.get(request_id)
        if entry is None or entry[0] != ids.epoch or entry[2] > n:
            buf, have = np.empty(max(n, 64), dtype=np.int64), 0
        else:
            _, buf, have = entry
            if n > len(buf):
                grown = np.empty(max(n, 2 * len(buf)), dtype=np.int64)
                grown[:have] = buf[:have]
                buf = grown
        if n > have:
            buf[have:n] = ids[have:n]
        self._rows[request_id] = (ids.epoch, buf, n)
        return buf[:n]

    def retain(self, request_ids: set[str]) -> None:
        """Forget requests not in this step once the mirror holds many more than it (finished ones)."""
        if len(self._rows) > 2 * len(request_ids) + 64:
            self._rows = {rid: row for rid, row in self._rows.items() if rid in request_ids}
