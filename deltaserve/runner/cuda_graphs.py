"""`DecodeGraphs`: pure-decode steps run on static input buffers at padded batch sizes, captured as CUDA graphs.

On a GPU a decode step of a small batch is launch-bound: hundreds of small kernels, each queued by Python. A CUDA
graph per batch size (vLLM's `--cuda-graph-sizes`) records the whole forward and LM head once, on input tensors that
keep their addresses, and replays it with a single launch. A step of n sequences runs at the smallest captured size
s >= n; a step with prefill or verify rows, more sequences than the largest size, a wider block table than captured,
or image features runs eagerly as before.

Padding rows (n..s-1) decode token 0 at position 0 of `pad_block` with state slot `pad_slot`: a block and a slot the
runner allocates past the cache manager's pools, so no request ever holds them. They write only there, and no op of a
decode row reads another row (attention, the KDA recurrence and the MoE are per row), so the real rows' tokens do not
depend on them. Everything the forward's Python reads from the batch (row counts, `decode_slot_range` None) is fixed
per size, which is what lets a replay stand for the forward: the captured kernels read slots, block tables and
context lengths from the static buffers.

Without capture (`capture=False`, e.g. on a CPU) `step` runs the same padded forward eagerly on the same buffers:
the reference twin of a replay, which the CPU tests compare with unpadded steps (`DELTASERVE_CPU_DECODE_GRAPHS=1`
turns it on in a CPU engine). A capture that fails (an op that reads the device back, a kernel that cannot be
captured) logs one line and leaves the engine eager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.layers.forward_batch import ForwardBatch, LayerCache
from deltaserve.models.protocol import Model

logger = logging.getLogger(__name__)

MAX_DEFAULT_SIZE = 512
"""The largest size captured by default (vLLM's default list ends there too)."""


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What a `ModelRunner` sets its decode graphs up with (the worker decides whether it has any)."""

    sizes: tuple[int, ...]
    max_blocks: int
    """Block table width of the static batch: the blocks of the longest sequence the engine admits."""
    capture: bool
    """Capture CUDA graphs (a GPU); False: the padded eager twin only."""


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default capture sizes, 1, 2, 4, then every multiple of 8, up to `max_num_seqs` (and 512)."""
    top = min(max_num_seqs, MAX_DEFAULT_SIZE)
    return tuple(s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top) or (1,)


class DecodeGraphs:
    """Static decode inputs for sizes `sizes`, a CUDA graph per size once `capture` ran."""

    def __init__(self, model: Model, caches: Sequence[LayerCache], *, sizes: Sequence[int], max_blocks: int,
                 block_size: int, pad_block: int, pad_slot: int, device: torch.device) -> None:
        """`caches`: the runner's cache tensors (graphs read and write these very tensors); `max_blocks`: the block
        table width captured (a wider step runs eagerly); `pad_block`, `pad_slot`: held by no request."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {list(sizes)}")
        self.model, self.caches = model, caches
        self.sizes = tuple(sorted(set(sizes)))
        self.max_blocks, self.block_size = max_blocks, block_size
        self.pad_block, self.pad_slot = pad_block, pad_slot
        top = self.sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(top + 1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(top, dtype=torch.long, device=device)
        self.state_indices = torch.full((top,), pad_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((top, max_blocks), pad_block, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), pad_block * block_size, dtype=torch.long, device=device)
        self._batches = {s: self._batch(s) for s in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        """Steps served by a graph replay (or, uncaptured, by the padded eager twin)."""

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest size that holds `num_seqs` rows (None: more than the largest)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Run every size's padded forward twice (Triton compiles and lazy initialisations happen here, not in a
        capture) with CUDA's sync debug mode on "error": an op that reads the device back or copies from pageable
        host memory, which a capture cannot hold, fails here, before any capture has begun. False (logged) if one
        does."""
        mode: int | None = None
        try:
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            for s in reversed(self.sizes):
                self._pad(0, s)
                for _ in range(2):
                    self._forward(s, self.caches)
            torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure leaves the engine correct, only eager
            logger.warning("CUDA graphs off: a decode step cannot be captured (%s: %s); decoding eagerly",
                           type(e).__name__, e)
            return False
        finally:
            if mode is not None:
                torch.cuda.set_sync_debug_mode(mode)
        return True

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture a graph per size, largest first, all in one memory pool (after `warm_up`); False (logged, no
        graph kept) if a capture fails."""
        try:
            pool = torch.cuda.graph_pool_handle()
            for s in reversed(self.sizes):
                self._pad(0, s)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the NCCL watchdog's calls from its own thread do not invalidate the capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self._forward(s, self.caches)
                self._graphs[s] = (graph, logits)
        except Exception as e:  # noqa: BLE001 - any failure leaves the engine correct, only eager
            self._graphs.clear()
            logger.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            return False
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", list(self.sizes))
        return True

    def step(self, ids: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]) -> torch.Tensor | None:
        """fp32 logits ``[n, vocab]`` of a pure-decode batch of n rows (`ids` ``[n]``, `batch` as `InputBatch`
        built it), from a replay (or the padded eager twin); None where no size fits: run it eagerly. `caches`: the
        runner's caches as this step sees them (a staged view: every layer is prepared before a replay)."""
        n = ids.shape[0]
        size = self.size_for(n)
        width = batch.block_tables.shape[1]
        if size is None or width > self.max_blocks or batch.num_decodes != n:
            return None
        self.ids[:n].copy_(ids, non_blocking=True)
        self.context_lens[:n].copy_(batch.context_lens, non_blocking=True)
        self.state_indices[:n].copy_(batch.state_indices, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(self.pad_block)
        self._pad(n, size)
        self.replays += 1
        if size in self._graphs:
            for _ in caches:  # the step's copies and state resets, every layer, before the graph reads any
                pass
            graph, logits = self._graphs[size]
            graph.replay()
            return logits[:n]
        return self._forward(size, caches)[:n]

    def _pad(self, start: int, stop: int) -> None:
        """Rows start..stop-1 become padding (a step before may have left a real request's slot and blocks there)."""
        if start >= stop:
            return
        self.ids[start:stop].zero_()
        self.context_lens[start:stop].fill_(1)
        self.state_indices[start:stop].fill_(self.pad_slot)
        self.block_tables[start:stop].fill_(self.pad_block)
        self.slot_mapping[start:stop].fill_(self.pad_block * self.block_size)

    def _forward(self, size: int, caches: Sequence[LayerCache]) -> torch.Tensor:
        hidden = self.model(self.ids[:size], self._batches[size], caches)
        return self.model.compute_logits(hidden)

    def _batch(self, size: int) -> ForwardBatch:
        """The static batch of `size` decode rows: views of the buffers, so a replay reads what `step` wrote."""
        return ForwardBatch(cu_seqlens=self.cu_seqlens[: size + 1], cu_seqlens_host=tuple(range(size + 1)),
                            context_lens=self.context_lens[:size], num_decodes=size,
                            state_indices=self.state_indices[:size], block_tables=self.block_tables[:size],
                            slot_mapping=self.slot_mapping[:size])
