"""Executors: how the engine core reaches the model. The core keeps the scheduler and the cache bookkeeping; a
`Worker` owns the device, the model, the cache tensors and the sampler; an `Executor` runs one step on its workers.
"""

from deltaserve.config import EngineConfig
from deltaserve.executor.base import Executor, WorkerDiedError, WorkerInfo

__all__ = ["Executor", "WorkerDiedError", "WorkerInfo", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """The executor named by `config.parallel.distributed_executor_backend` ('uni' or 'mp'), its workers started
    and the model loaded. Imported lazily: the multiprocess executor never needs torch in this process."""
    if config.parallel.distributed_executor_backend == "mp":
        from deltaserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from deltaserve.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
