"""Executors: how the engine core reaches the model. The core keeps the scheduler and the cache bookkeeping; a
`Worker` owns the device, the model, the cache tensors and the sampler; an `Executor` runs one step on its workers.
"""

from deltaserve.executor.base import Executor, WorkerDiedError, WorkerInfo, make_executor

__all__ = ["Executor", "WorkerDiedError", "WorkerInfo", "make_executor"]
