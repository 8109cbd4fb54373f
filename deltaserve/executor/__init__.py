"""Executors: how the engine core reaches the model. The core keeps the scheduler and the cache bookkeeping; a
`Worker` owns the device, the model, the cache tensors and the sampler; an `Executor` runs one step on its workers.
"""

from deltaserve.config import EngineConfig
from deltaserve.executor.base import Executor, WorkerDiedError, WorkerInfo

__all__ = ["Executor", "WorkerDiedError", "WorkerInfo", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """The executor named by `config.parallel.executor_backend` ('uni', 'mp' or 'ray'), its workers started and the
    model loaded. Imported lazily: the multiprocess and Ray executors never need torch in this process."""
    backend = config.parallel.executor_backend
    if backend == "ray":
        from deltaserve.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if backend == "mp":
        from deltaserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from deltaserve.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
