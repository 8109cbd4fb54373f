"""`UniprocExecutor`: the worker lives in the engine core's own process and thread (the default; no copies)."""

from __future__ import annotations

from deltaserve.cache.planner import CacheLayout
from deltaserve.config import EngineConfig
from deltaserve.executor.base import WorkerInfo
from deltaserve.executor.worker import Worker
from deltaserve.scheduler.output import RunnerOutput, SchedulerOutput


class UniprocExecutor:
    """One in-process worker, called directly."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def describe(self) -> WorkerInfo:
        return self.worker.describe()

    def initialize_cache(self, layout: CacheLayout, num_slots: int) -> None:
        self.worker.initialize_cache(layout, num_slots)

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(out)

    def time_step(self, num_seqs: int, query_len: int, context_len: int) -> float:
        return self.worker.time_step(num_seqs, query_len, context_len)

    def time_draft(self, num_seqs: int) -> float:
        return self.worker.time_draft(num_seqs)

    def shutdown(self) -> None:
        self.worker.close()
