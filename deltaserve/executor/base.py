"""The `Executor` protocol between the engine core and its workers, and what workers report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.executor.block_sync import BlockTableSender
from deltaserve.scheduler.output import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from deltaserve.cache.planner import CacheLayout


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine depended on it: fatal for the engine (never retried)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """What a worker reports once its model is loaded, for the core to plan the cache."""

    cache_specs: tuple[KVCacheSpec | StateCacheSpec, ...]
    """Per layer, what it keeps (the model's `cache_specs()`)."""
    available_memory_bytes: int
    """Free memory of the worker's device, after loading the model."""
    device: str
    """Where the model lives ('cpu', 'cuda:0')."""
    weight_bytes: int = 0
    """Bytes of this rank's parameters (its shard under tensor / expert parallelism), counted from the tensors."""
    transfer_addresses: tuple[str, ...] = ()
    """Disaggregation, prefill side: each rank's transfer server, in rank order (one per worker; merged)."""
    decode_graphs: bool = False
    """Whether the runner will pad decode steps for CUDA graphs: it then allocates one KV block and one state slot
    past the planned pools for the padding rows (the planner reserves them)."""


def merge_infos(infos: list[WorkerInfo]) -> WorkerInfo:
    """One report for the core from every rank's: rank 0's specs, the smallest free memory, the largest weights."""
    first = infos[0]
    return WorkerInfo(cache_specs=first.cache_specs, device=first.device,
                      available_memory_bytes=min(i.available_memory_bytes for i in infos),
                      weight_bytes=max(i.weight_bytes for i in infos),
                      transfer_addresses=tuple(a for i in infos for a in i.transfer_addresses),
                      decode_graphs=any(i.decode_graphs for i in infos))


class Executor(Protocol):
    """Runs the model for the engine core. Every method is called from the core's thread, one at a time."""

    def describe(self) -> WorkerInfo:
        """What the workers loaded (the smallest free memory and the largest weights of all ranks)."""
        ...

    def initialize_cache(self, layout: CacheLayout, num_slots: int) -> None:
        """Allocate the cache tensors: `layout.num_blocks` KV blocks and `num_slots` state slots (running,
        checkpoint and scratch slots together), and build the model runner."""
        ...

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step on every worker; rank 0's sampled tokens. Raises WorkerDiedError when a worker
        is gone; any other exception is a failed step (the core ends the requests it held and goes on)."""
        ...

    def time_step(self, num_seqs: int, query_len: int, context_len: int) -> float:
        """Seconds of one speculative-verification forward on the workers (`ModelRunner.time_step`): the adaptive
        verifier's cost model, measured after `initialize_cache` and before any step."""
        ...

    def time_draft(self, num_seqs: int) -> float:
        """Seconds of one block-drafter forward for `num_seqs` requests (`BlockDrafting.time_draft`)."""
        ...

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        ...


class BroadcastExecutor:
    """The `Executor` methods shared by the executors that send every call to all ranks and answer with rank 0's
    result: a subclass provides `_infos` (every rank's `WorkerInfo`) and `_call`. Block tables travel as what each
    step appended (`block_sync.py`)."""

    _infos: list[WorkerInfo]
    _block_sender: BlockTableSender | None = None

    def _call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank's worker; rank 0's result."""
        raise NotImplementedError

    def describe(self) -> WorkerInfo:
        return merge_infos(self._infos)

    def initialize_cache(self, layout: CacheLayout, num_slots: int) -> None:
        self._call("initialize_cache", layout, num_slots)

    def time_step(self, num_seqs: int, query_len: int, context_len: int) -> float:
        return float(self._call("time_step", num_seqs, query_len, context_len))

    def time_draft(self, num_seqs: int) -> float:
        return float(self._call("time_draft", num_seqs))

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        if self._block_sender is None:
            self._block_sender = BlockTableSender()
        result = self._call("execute_model", self._block_sender.encode(out))
        assert isinstance(result, RunnerOutput)
        return result
