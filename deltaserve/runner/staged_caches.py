"""The device caches as one step's forward sees them: layer i is handed out only once the step's host-tier copies of
that layer are done and its device-side step operations (cached partial blocks and checkpoints copied into the
requests that hit them, fresh state slots zeroed) are applied, in that order: a slot or block demoted to the host
this step may be the one a new request then zeroes or overwrites."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

from deltaserve.layers.forward_batch import LayerCache
from deltaserve.runner.host_cache import HostCopyJob


class StagedCaches(Sequence[LayerCache]):
    """A `Sequence[LayerCache]` for `Model.forward` (which reads layer i's cache just before running layer i): each
    layer is prepared on first access; `finish` prepares the layers the forward did not reach (a step without
    chunks, or a forward that raised) and returns the copies' seconds."""

    def __init__(self, caches: Sequence[LayerCache], job: HostCopyJob,
                 prepare: Callable[[LayerCache], None]) -> None:
        self._caches, self._job, self._prepare = caches, job, prepare
        self._ready = [False] * len(caches)

    def _get(self, i: int) -> LayerCache:
        cache = self._caches[i]
        if not self._ready[i]:
            self._job.wait(i)
            self._prepare(cache)
            self._ready[i] = True
        return cache

    @overload
    def __getitem__(self, i: int) -> LayerCache: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[LayerCache]: ...

    def __getitem__(self, i: int | slice) -> LayerCache | Sequence[LayerCache]:
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(len(self)))]
        return self._get(range(len(self))[i])

    def __len__(self) -> int:
        return len(self._caches)

    def __iter__(self) -> Iterator[LayerCache]:
        return (self._get(i) for i in range(len(self)))

    def finish(self) -> float:
        """Every layer prepared and every copy done; the seconds the host-tier copies took."""
        for i in range(len(self)):
            self._get(i)
        return self._job.finish()
