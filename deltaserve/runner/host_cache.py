"""The host tier's tensors (L2 of the prefix cache): per layer, host KV blocks and host state slots, and the copies
between them and the device caches that the scheduler queues (`cache.host_tier.HostCopies`).

The copies overlap the forward layer by layer (`HostCopyJob`): layer i's copies are issued before the step's compute
and the forward waits only for them before it runs layer i, so layers 1..n load while layers 0..n-1 compute (as
SGLang's HiCache loads a hit back). On a GPU they run on a copy stream, from and to pinned host memory, with one
event per layer; on a CPU (only when asked: two cores gain nothing from it) in a background thread, one
`threading.Event` per layer. Without overlap (the CPU default, and the reference twin) every copy is done before the
forward starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from deltaserve.cache.host_tier import HostCopies
from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.layers.forward_batch import KDALayerCache, LayerCache, MLALayerCache
from deltaserve.runner.kv_tensors import allocate_layer_caches

LayerCopy = Callable[[], None]
"""One layer's copies: device -> host first (this step may reuse that device memory), then host -> device."""


class HostCopyJob:
    """A step's host-tier copies in flight: `wait(i)` before the forward touches layer i, `finish()` after it. This
    base class is the job of a step with nothing to copy."""

    def wait(self, layer: int) -> None:
        """Return once layer `layer`'s copies are done (or ordered before the compute that follows, on a GPU)."""

    def finish(self) -> float:
        """Wait for every copy; the seconds they took on their stream or thread (re-raises a copy's failure)."""
        return 0.0


class _DoneJob(HostCopyJob):
    """Copies already done (the reference twin, or nothing to copy)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self._seconds = seconds

    def finish(self) -> float:
        return self._seconds


class _ThreadJob(HostCopyJob):
    """The copies in a background thread, layer after layer, each layer's end signalled by an event. The copies are
    torch ops that release the GIL while they move memory, so they run beside the forward's compute."""

    def __init__(self, layers: Sequence[LayerCopy]) -> None:
        self._ready = [threading.Event() for _ in layers]
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(layers,), name="host-copies", daemon=True)
        self._thread.start()

    def _run(self, layers: Sequence[LayerCopy]) -> None:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for copy, ready in zip(layers, self._ready, strict=True):
                    copy()
                    ready.set()
        except BaseException as e:  # handed to the step's thread: it re-raises in wait() and finish()
            self._error = e
        finally:
            self._seconds = time.perf_counter() - start
            for ready in self._ready:  # a failed job releases every waiter (who then raises)
                ready.set()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a host-tier copy failed: {self._error!r}") from self._error

    def wait(self, layer: int) -> None:
        self._ready[layer].wait()
        self._check()

    def finish(self) -> float:
        self._thread.join()
        self._check()
        return self._seconds


class _StreamJob(HostCopyJob):
    """The copies issued on a side CUDA stream (after the work already queued on the compute stream, which may still
    be writing the blocks being demoted), one event recorded after each layer; `wait(i)` makes the compute stream
    wait for event i, without blocking the host."""

    def __init__(self, layers: Sequence[LayerCopy], stream: torch.cuda.Stream) -> None:
        self._device = stream.device
        stream.wait_stream(torch.cuda.current_stream(self._device))
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._ready: list[torch.cuda.Event] = []
        with torch.cuda.stream(stream):
            self._start.record(stream)
            for copy in layers:
                copy()
                event = torch.cuda.Event()
                event.record(stream)
                self._ready.append(event)
            self._end.record(stream)

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._ready[layer])

    def finish(self) -> float:
        # The host tier's memory is written by the host after the step (shared-store and transfer fetches, into
        # entries this step does not touch) and read by the next step's copies, which are ordered after these on the
        # same stream; waiting here keeps "the step's copies are done when execute returns" true on every device.
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000


class HostCache:
    """Host copies of `num_blocks` KV blocks and `num_slots` state slots for every layer, in host memory (pinned on
    a GPU machine, so the copies are DMA transfers that can overlap compute)."""

    def __init__(self, specs: Sequence[KVCacheSpec | StateCacheSpec], *, num_blocks: int, num_slots: int,
                 block_size: int, device: torch.device, overlap: bool | None = None) -> None:
        """`overlap`: copies run beside the forward, layer by layer (False: all done before it, the reference; None:
        beside it on a GPU, before it on a CPU, where a copy thread measured slower: it takes cores from the
        forward)."""
        self.caches = allocate_layer_caches(specs, num_blocks=max(num_blocks, 1), block_size=block_size,
                                            num_slots=max(num_slots, 1), device="cpu")
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.block_size = block_size
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self.caches = [_pinned(c) for c in self.caches]
            self._stream = torch.cuda.Stream(device)
        self.bytes_out = self.bytes_in = 0

    def start(self, copies: HostCopies, device_caches: Sequence[LayerCache]) -> HostCopyJob:
        """Start the step's copies; the caller waits for layer i (`HostCopyJob.wait`) before touching it."""
        layers = self._layer_copies(copies, device_caches)
        if not self.overlap:
            start = time.perf_counter()
            for copy in layers:
                copy()
            return _DoneJob(time.perf_counter() - start)
        if self._stream is not None:
            return _StreamJob(layers, self._stream)
        return _ThreadJob(layers)

    def _layer_copies(self, copies: HostCopies, device_caches: Sequence[LayerCache]) -> list[LayerCopy]:
        """One closure per layer; the byte counters are updated here (the sizes are known before any copy)."""
        index = _Indices(copies, self.block_size)
        layers: list[LayerCopy] = []
        for host, dev in zip(self.caches, device_caches, strict=True):
            if isinstance(host, KDALayerCache) and isinstance(dev, KDALayerCache):
                self.bytes_out += index.row_bytes(host.state, host.conv, len(copies.states_out))
                self.bytes_in += index.row_bytes(host.state, host.conv, len(copies.states_in))
                layers.append(_state_copy(index, host, dev))
            elif isinstance(host, MLALayerCache) and isinstance(dev, MLALayerCache):
                self.bytes_out += index.row_bytes(host.kv, None, len(copies.blocks_out))
                row = host.kv.shape[-1] * host.kv.element_size()
                self.bytes_in += sum(rows for _, _, rows in copies.blocks_in) * row
                layers.append(_kv_copy(index, host, dev, copies.blocks_in))
            else:
                raise TypeError(f"host and device caches disagree on a layer's kind: {type(host)} vs {type(dev)}")
        return layers


class _Indices:
    """The copies' row pairs by name, and as index tensors (made on first use, then shared by every layer of the
    step) for the copies within one device."""

    def __init__(self, copies: HostCopies, block_size: int) -> None:
        self.pairs: dict[str, Sequence[tuple[int, int]]] = {
            "blocks_out": copies.blocks_out, "states_out": copies.states_out, "states_in": copies.states_in,
            "full_blocks_in": [(src, dst) for src, dst, rows in copies.blocks_in if rows == block_size]}
        self._cache: dict[tuple[str, int, str], torch.Tensor] = {}

    def get(self, name: str, side: int, device: torch.device) -> torch.Tensor:
        key = (name, side, str(device))
        if key not in self._cache:
            self._cache[key] = torch.tensor([p[side] for p in self.pairs[name]], dtype=torch.long, device=device)
        return self._cache[key]

    @staticmethod
    def row_bytes(a: torch.Tensor, b: torch.Tensor | None, n: int) -> int:
        return n * (a[0].numel() * a.element_size() + (0 if b is None else b[0].numel() * b.element_size()))


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, index: _Indices, name: str) -> None:
    """dst[j] = src[i] for every (i, j) of `index.pairs[name]`. Between a device and the host: one async copy per
    row, so that pinned rows move by DMA on the current stream with no staging buffer; within one device (the CPU):
    one gather and one scatter."""
    pairs = index.pairs[name]
    if not pairs:
        return
    if src.device != dst.device:
        for i, j in pairs:
            dst[j].copy_(src[i], non_blocking=True)
        return
    dst.index_copy_(0, index.get(name, 1, dst.device), src.index_select(0, index.get(name, 0, src.device)))


def _state_copy(index: _Indices, host: KDALayerCache, dev: KDALayerCache) -> LayerCopy:
    def copy() -> None:
        for src, dst in ((dev.state, host.state), (dev.conv, host.conv)):
            _copy_rows(src, dst, index, "states_out")
        for src, dst in ((host.state, dev.state), (host.conv, dev.conv)):
            _copy_rows(src, dst, index, "states_in")
    return copy


def _kv_copy(index: _Indices, host: MLALayerCache, dev: MLALayerCache,
             blocks_in: Sequence[tuple[int, int, int]]) -> LayerCopy:
    def copy() -> None:
        _copy_rows(dev.kv, host.kv, index, "blocks_out")
        _copy_rows(host.kv, dev.kv, index, "full_blocks_in")
        for src, dst, rows in blocks_in:
            if rows < host.kv.shape[1]:  # a partial block copies only its rows
                dev.kv[dst, :rows].copy_(host.kv[src, :rows], non_blocking=True)
    return copy


def _pinned(cache: LayerCache) -> LayerCache:
    if isinstance(cache, KDALayerCache):
        return KDALayerCache(cache.state.pin_memory(), cache.conv.pin_memory())
    return MLALayerCache(cache.kv.pin_memory())
