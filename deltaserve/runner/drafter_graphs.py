"""`DrafterGraphs`: the block drafter's forward compiled ahead of time (AOTInductor) on a CPU, one graph per batch-size
bucket, compiled off the request path.

Why: the drafter's forward is ~45 small ops, and on a CPU the time between them (Python, dispatch) is as large as the
ops; compiled into one C++ graph it runs 1.3-1.8x as fast (docs/benchmarks.md, "The drafter's graphs adopted").

How, without stalling a request: a batch whose bucket has no graph yet runs eagerly, and the bucket's graph is
compiled by one background thread from a copy of the drafter (export re-parametrises the module it traces, which
must not happen under the eager forward), written to the compile cache (`envs.compile_cache_dir`, keyed by the
drafter's weights, dtype, torch version, CPU capability, thread count and bucket) and loaded at the next call; a later
run loads it from there in milliseconds. A compile or load that fails logs one line and leaves the drafter eager.
Batches are padded to the next power of two up to `MAX_BATCH` (padding rows have no valid context and are sliced off:
rows do not interact); larger batches run eagerly, their ops big enough to hide the overhead. Off with
`--enforce-eager` or `DELTASERVE_DRAFTER_GRAPHS=0`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import Tensor

from deltaserve import envs
from deltaserve.models.dspark import DSparkDrafter

logger = logging.getLogger(__name__)
# torch's own export of a module warns about its internals (2.13); nothing a user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

MAX_BATCH = 16
"""Largest bucket compiled: the batch sizes where the drafter's forward is overhead-bound on a CPU."""

Forward = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(features [B, W, F], valid [B, W], first_embeds [B, d]) -> drafted hidden states [B, block_size, d]."""
CompileFn = Callable[[DSparkDrafter, int, Path], None]
"""(drafter, batch rows, package path): write the drafter's graph at that batch size to the path."""
LoadFn = Callable[[Path], Forward]


def aoti_compile(drafter: DSparkDrafter, batch: int, path: Path) -> None:
    """Export `drafter` at `batch` rows and compile it with AOTInductor into the package `path` (written under a
    temporary name, then renamed: a reader never sees half a package)."""
    cfg = drafter.config
    dtype = next(drafter.parameters()).dtype
    args = (torch.zeros(batch, cfg.context_window, cfg.feature_size, dtype=dtype),
            torch.ones(batch, cfg.context_window, dtype=torch.bool), torch.zeros(batch, cfg.hidden_size, dtype=dtype))
    with torch.no_grad():
        program = torch.export.export(drafter, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}-{threading.get_ident()}.tmp.pt2")
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def aoti_load(path: Path) -> Forward:
    """The compiled graph of a package `aoti_compile` wrote."""
    return torch._inductor.aoti_load_package(str(path))


def bucket_of(batch: int) -> int:
    """The graph batch size that serves `batch` rows: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


class DrafterGraphs:
    """Callable as the drafter (`forward(features, valid, first_embeds, num_drafts)`): a compiled graph where its
    bucket has one, the eager drafter otherwise (see the module docstring)."""

    def __init__(self, drafter: DSparkDrafter, *, cache_dir: Path | None = None, compile_fn: CompileFn = aoti_compile,
                 load_fn: LoadFn = aoti_load, max_batch: int = MAX_BATCH) -> None:
        self.drafter, self.max_batch = drafter, max_batch
        self._compile, self._load = compile_fn, load_fn
        self._dir = cache_dir if cache_dir is not None else envs.compile_cache_dir()
        self._threads = torch.get_num_threads()
        self._key = _cache_key(drafter, self._threads)
        self._graphs: dict[int, Forward] = {}
        self._jobs: dict[int, Future[float]] = {}
        self._queue: queue.SimpleQueue[tuple[Future[float], int, Path]] | None = None
        self.enabled = True
        """False once a compile or load failed: every batch then runs eagerly."""

    def __call__(self, features: Tensor, valid: Tensor, first_embeds: Tensor, num_drafts: int | None = None) -> Tensor:
        b = features.shape[0]
        full = num_drafts is None or num_drafts == self.drafter.config.block_size
        graph = self._graph(bucket_of(b)) if self.enabled and full and b <= self.max_batch else None
        if graph is None:
            return self.drafter(features, valid, first_embeds, num_drafts)
        pad = bucket_of(b) - b
        if pad:
            features = torch.cat([features, features.new_zeros(pad, *features.shape[1:])])
            valid = torch.cat([valid, valid.new_zeros(pad, valid.shape[1])])
            first_embeds = torch.cat([first_embeds, first_embeds.new_zeros(pad, first_embeds.shape[1])])
        return graph(features.contiguous(), valid.contiguous(), first_embeds.contiguous())[:b]

    def job(self, batch: int) -> Future[float] | None:
        """The compile in flight (or queued) for `batch`'s bucket, if any: its result is the seconds it took."""
        return self._jobs.get(bucket_of(batch))

    def ready(self, batch: int) -> bool:
        """Whether `batch` rows would run a compiled graph now (it loads a finished compile)."""
        return self.enabled and batch <= self.max_batch and self._graph(bucket_of(batch), start=False) is not None

    def _graph(self, bucket: int, *, start: bool = True) -> Forward | None:
        graph = self._graphs.get(bucket)
        if graph is not None:
            return graph
        path = self._dir / f"dspark-{self._key}-b{bucket}.pt2"
        job = self._jobs.get(bucket)
        if job is None:
            if path.exists():
                return self._load_graph(bucket, path, None)
            if start:
                self._jobs[bucket] = self._submit(bucket, path)
            return None
        if not job.done():
            return None
        del self._jobs[bucket]
        try:
            seconds = job.result()
        except Exception as e:  # a compiler missing or failing: eager from now on, said once
            self._disable(f"compiling its batch-{bucket} graph failed ({type(e).__name__}: {e})")
            return None
        return self._load_graph(bucket, path, seconds)

    def _load_graph(self, bucket: int, path: Path, compile_s: float | None) -> Forward | None:
        try:
            graph = self._graphs[bucket] = self._load(path)
        except Exception as e:
            self._disable(f"loading its batch-{bucket} graph {path} failed ({type(e).__name__}: {e})")
            return None
        logger.info("dspark drafter: batch-%d graph %s", bucket,
                    "loaded from the compile cache" if compile_s is None else f"compiled in {compile_s:.1f} s")
        return graph

    def _disable(self, why: str) -> None:
        self.enabled = False
        logger.warning("dspark drafter: %s; it runs eagerly", why)

    def _submit(self, bucket: int, path: Path) -> Future[float]:
        job: Future[float] = Future()
        if self._queue is None:  # daemon: a process may exit with a compile in flight
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(self._queue,), name="dspark-compile", daemon=True).start()
        self._queue.put((job, bucket, path))
        return job

    def _work(self, jobs: queue.SimpleQueue[tuple[Future[float], int, Path]]) -> None:
        torch.set_num_threads(self._threads)  # a new thread starts with the default count; the graph is built for ours
        drafter = None
        while True:
            job, bucket, path = jobs.get()
            start = time.perf_counter()
            try:
                drafter = drafter or copy.deepcopy(self.drafter)
                self._compile(drafter, bucket, path)
            except BaseException as e:
                job.set_exception(e)
            else:
                job.set_result(time.perf_counter() - start)


def _cache_key(drafter: DSparkDrafter, threads: int) -> str:
    """What a compiled graph depends on besides its batch: the drafter's config and weights, torch, the CPU, the
    thread count."""
    h = hashlib.sha256(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{threads}|"
                       f"{drafter.config.to_json()}".encode())
    for name, tensor in drafter.state_dict().items():
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]
