"""`DPEngineClient`: the `EngineClient` (protocol.py) of N data-parallel engine replicas behind one router.

Each replica is an `AsyncEngineClient` (client.py): an engine process of its own with its own workers, cache and
prefix cache, started from the same `EngineConfig` with `data_parallel_size=1` and, on a CPU, its share of the
engine threads (`num_threads // N`, at least one); with `device='cuda'` (and the 'uni' or 'mp' executor) replica i
sees only its own `tensor_parallel_size` GPUs, the i-th group of `CUDA_VISIBLE_DEVICES` (or of 0, 1, ...), through
its process's `CUDA_VISIBLE_DEVICES` (`replica_env`). A request is routed once, when its iteration starts, by the
`Router` (dp_router.py: session- or prefix-affine, else least loaded) and then streams from its replica exactly
as from a single engine; `abort` goes to the replica that holds the request.

A replica whose engine process dies fails its own requests in flight with `EngineDeadError` (client.py's path);
from then on the router skips it and forgets its session and prefix entries, so new requests go to the survivors.
The client as a whole is alive while any replica is: `wait_exited` returns once every replica has exited, which
is when the server does what it does for a dead single engine (exit 1, or `--restart-engine`, which here restarts
each replica as it dies: `restart_replica`).

`get_stats` asks every live replica and adds the snapshots up (gauges and counters alike; `merge_stats`); the
counters of a replica that died are kept and added to the live ones' (a restarted replica counts from 0 again), so
the merged counters never go back. No torch here.

With `--enable-expert-parallel` the routed experts span the replicas (vLLM's DP attention + EP): each replica gets
its place and the two rendezvous (`expert_replica_configs`), its workers join one group with every other
replica's, and the replicas step in lockstep (`dp_lockstep.py`). They then live and die together: a replica that
dies breaks the others' exchanges, whose steps fail and whose engines exit (a clean error for every request, within
the group's timeout), and a lone restart cannot rejoin.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from deltaserve import envs
from deltaserve.config import EngineConfig
from deltaserve.config.dp_experts import ExpertReplicas
from deltaserve.engine.client import AsyncEngineClient
from deltaserve.engine.dp_router import Router
from deltaserve.engine.messages import EngineCoreOutput, EngineInfo
from deltaserve.engine.protocol import EngineDeadError
from deltaserve.engine.stats import EngineStats
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams
from deltaserve.utils.cpu_threads import default_num_threads
from deltaserve.utils.ports import free_port

__all__ = ["DPEngineClient", "expert_replica_configs", "merge_stats", "replica_config", "replica_env"]

logger = logging.getLogger(__name__)

def replica_config(config: EngineConfig) -> EngineConfig:
    """The config of one of `config.parallel.data_parallel_size` replicas: one replica, and on a CPU its share of
    the engine threads (the replicas run side by side on the same cores)."""
    replicas = config.parallel.data_parallel_size
    threads = config.num_threads
    if config.device == "cpu" or threads is not None:
        threads = max(1, (threads or default_num_threads()) // replicas)
    return dataclasses.replace(config, num_threads=threads,
                               parallel=dataclasses.replace(config.parallel, data_parallel_size=1))


def expert_replica_configs(one: EngineConfig, replicas: int) -> list[EngineConfig]:
    """Each replica's config when the routed experts span the replicas: `one` with the replica's `ExpertReplicas`
    (its rank, and the two rendezvous every replica shares: its workers' group and its engine's lockstep group)."""
    workers, engines = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return [dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, expert_replicas=ExpertReplicas(
        rank=i, size=replicas, workers_address=workers, engines_address=engines))) for i in range(replicas)]


def replica_env(config: EngineConfig, index: int) -> dict[str, str]:
    """Environment of replica `index`'s engine process: on `device='cuda'` its own GPUs (`CUDA_VISIBLE_DEVICES`:
    the index-th group of `tensor_parallel_size` ids of this process's list, or of 0, 1, ... without one), so that
    its ranks find theirs as cuda:0, cuda:1, ...; nothing otherwise ('cuda:N' puts every replica on N; Ray gives
    its actors their GPUs itself). ValueError when the list has too few GPUs."""
    if config.device != "cuda" or config.parallel.executor_backend == "ray":
        return {}
    per_replica = config.parallel.world_size
    visible = envs.cuda_visible_devices()
    needed = per_replica * config.parallel.data_parallel_size
    if visible is None:
        visible = [str(i) for i in range(needed)]
    if len(visible) < needed:
        raise ValueError(f"data_parallel_size={config.parallel.data_parallel_size} x tensor_parallel_size="
                         f"{per_replica} needs {needed} GPUs but CUDA_VISIBLE_DEVICES lists {len(visible)}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[index * per_replica:(index + 1) * per_replica])}


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The sum of several replicas' snapshots: every field adds up (`spec_accepted_per_pos` position by
    position)."""
    if not parts:
        raise ValueError("no stats to merge")
    values: dict[str, object] = {}
    for field in dataclasses.fields(EngineStats):
        column = [getattr(p, field.name) for p in parts]
        if field.name == "spec_accepted_per_pos":
            width = max(len(c) for c in column)
            values[field.name] = tuple(sum(c[j] for c in column if j < len(c)) for j in range(width))
        else:
            values[field.name] = sum(column)
    return EngineStats(**values)  # type: ignore[arg-type]


def _counters_only(stats: EngineStats) -> EngineStats:
    """A dead replica's contribution: its counters; it holds nothing and has no capacity any more."""
    return dataclasses.replace(stats, num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=0,
                               state_slots_used=0, state_slots_total=0)


class DPEngineClient:
    """N replica clients and a router; see the module docstring. Create with `await DPEngineClient.start(config)`;
    all methods must be called from the event loop that started it."""

    def __init__(self, replicas: Sequence[AsyncEngineClient], router: Router) -> None:
        if len(replicas) != router.num_replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.num_replicas}")
        self.replicas = list(replicas)
        self.router = router
        self.info: EngineInfo = replicas[0].info
        """The first replica's (every replica runs the same config: the same limits, blocks and slots each)."""
        self._owners: dict[str, int] = {}
        """Request id -> the replica serving it."""
        self.routed = [0] * len(replicas)
        """Requests routed to each replica (cumulative)."""
        self._dead: set[int] = set()
        """Replicas whose death was handled (entries forgotten, counters retired) and that were not restarted."""
        self._last_stats: list[EngineStats | None] = [None] * len(replicas)
        self._retired: EngineStats | None = None
        """The counters of replica processes that died."""
        self._revived = [asyncio.Event() for _ in replicas]
        self._closing = False
        self._watchers = [asyncio.ensure_future(self._watch(i)) for i in range(len(replicas))]

    @classmethod
    async def start(cls, config: EngineConfig, *, startup_timeout_s: float = 600) -> DPEngineClient:
        """Start `config.parallel.data_parallel_size` engine processes at once and wait until all are ready.
        Raises the first replica's EngineStartError (the others are shut down)."""
        replicas = config.parallel.data_parallel_size
        one = replica_config(config)
        configs = expert_replica_configs(one, replicas) if config.parallel.experts_span_replicas else [one] * replicas
        placements = [replica_env(config, i) for i in range(replicas)]
        logger.info("starting %d data-parallel engine replicas (%s threads each, routing: %s%s)", replicas,
                    one.num_threads, config.parallel.load_balance_method,
                    "".join(f"; replica {i}: {env}" for i, env in enumerate(placements) if env))
        results = await asyncio.gather(*(AsyncEngineClient.start(c, startup_timeout_s=startup_timeout_s, env=env)
                                         for c, env in zip(configs, placements, strict=True)),
                                       return_exceptions=True)
        started = [r for r in results if isinstance(r, AsyncEngineClient)]
        failures = [r for r in results if not isinstance(r, AsyncEngineClient)]
        if failures:
            await asyncio.gather(*(r.shutdown() for r in started), return_exceptions=True)
            raise failures[0]
        router = Router(replicas, block_size=started[0].info.block_size,
                        session_affinity=config.parallel.load_balance_method == "session_affinity")
        return cls(started, router)

    # -- requests --------------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                       kv_transfer_params: dict[str, Any] | None = None, images: tuple[ImageInput, ...] = ()
                       ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Route the request (when iteration starts) and stream it from its replica; the protocol's contract.
        EngineDeadError when every replica is dead, or when the request's replica dies while it runs."""
        if params.n != 1:
            raise ValueError(f"generate takes n=1 sampling params (got n={params.n}); fan out n in the frontend")
        if request_id in self._owners:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            index = self.router.route(prompt_token_ids, self._loads(), session_id)
        except ValueError:
            raise EngineDeadError(self._dead_reason()) from None
        self._owners[request_id] = index
        self.routed[index] += 1
        record = self.router.session_affinity
        output: list[int] = []
        try:
            outputs = self.replicas[index].generate(request_id, prompt_token_ids, params,
                                                    eos_token_ids=eos_token_ids, priority=priority,
                                                    kv_transfer_params=kv_transfer_params, images=images)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if record:
                        output.extend(out.new_token_ids)
                        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                            self.router.finished(prompt_token_ids + output, index)
                    yield out
        finally:
            if self._owners.get(request_id) == index:
                del self._owners[request_id]

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request on the replica that serves it; unknown ids are ignored."""
        index = self._owners.get(request_id)
        if index is not None:
            await self.replicas[index].abort(request_id, reason)

    async def get_stats(self, *, reset_prefix_cache: bool = False) -> EngineStats:
        """Every live replica's fresh snapshot, added up with the counters of replicas that died (`merge_stats`);
        `reset_prefix_cache` resets every live replica's (and the router's entries, which pointed at those caches).
        EngineDeadError when every replica is dead."""
        if reset_prefix_cache:
            self.router.clear()
        live = [i for i, r in enumerate(self.replicas) if r.is_alive]
        results = await asyncio.gather(*(self.replicas[i].get_stats(reset_prefix_cache=reset_prefix_cache)
                                         for i in live), return_exceptions=True)
        for i, result in zip(live, results, strict=True):
            if isinstance(result, EngineStats):
                self._last_stats[i] = result
            elif not isinstance(result, EngineDeadError):  # died meanwhile: its last snapshot will do
                raise result
        self._handle_deaths()
        parts = [s for i, s in enumerate(self._last_stats) if s is not None and self.replicas[i].is_alive]
        if not parts:
            raise EngineDeadError(self._dead_reason())
        return merge_stats(parts if self._retired is None else [*parts, self._retired])

    @property
    def is_alive(self) -> bool:
        """True while any replica is alive."""
        return any(r.is_alive for r in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    @property
    def pids(self) -> list[int | None]:
        """The replicas' engine process ids, in replica order."""
        return [r.pid for r in self.replicas]

    def replica_status(self) -> list[dict[str, object]]:
        """Per replica: its engine process id, whether it is alive, its requests in flight and routed so far (the
        `data_parallel` part of /status.json)."""
        return [{"replica": i, "pid": r.pid, "alive": r.is_alive, "in_flight": r.num_unfinished,
                 "routed": self.routed[i]} for i, r in enumerate(self.replicas)]

    def heartbeat_age(self) -> float:
        """The freshest heartbeat of a live replica (a server with one replica left still serves); infinity when
        none is alive."""
        return min((r.heartbeat_age() for r in self.replicas if r.is_alive), default=float("inf"))

    # -- dead replicas ---------------------------------------------------------------------------------------------

    async def wait_exited(self) -> str:
        """Wait until every replica's engine process has exited; why the last ones did."""
        while True:
            reasons = await asyncio.gather(*(r.wait_exited() for r in self.replicas))
            if not self.is_alive:
                return f"every data-parallel replica exited ({'; '.join(reasons)})"

    async def restart_replica(self, index: int) -> None:
        """Start a new engine process for a replica whose process exited (`AsyncEngineClient.restart`)."""
        await self.replicas[index].restart()
        self._dead.discard(index)
        self._revived[index].set()
        logger.info("data-parallel replica %d restarted (engine process %s)", index, self.replicas[index].pid)

    async def _watch(self, index: int) -> None:
        """Handle replica `index`'s death as soon as it happens, then wait for its restart, if any."""
        replica = self.replicas[index]
        while not self._closing:
            await replica.wait_exited()
            if self._closing:
                return
            self._handle_deaths()
            await self._revived[index].wait()
            self._revived[index].clear()

    def _handle_deaths(self) -> None:
        """Forget the router entries and retire the counters of every replica that died since the last call."""
        for i, replica in enumerate(self.replicas):
            if replica.is_alive or i in self._dead or self._closing:
                continue
            self._dead.add(i)
            dropped = self.router.forget(i)
            last, self._last_stats[i] = self._last_stats[i], None
            if last is not None:
                retired = _counters_only(last)
                self._retired = retired if self._retired is None else merge_stats([self._retired, retired])
            alive = len(self.replicas) - len(self._dead)
            logger.error("data-parallel replica %d (engine process %s) died: %d of %d replicas serve; %d router "
                         "entries dropped", i, replica.pid, alive, len(self.replicas), dropped)

    def _loads(self) -> list[int | None]:
        self._handle_deaths()
        return [r.num_unfinished if r.is_alive else None for r in self.replicas]

    def _dead_reason(self) -> str:
        return "every data-parallel engine replica is dead" if not self._closing else "the engine is shutting down"

    # -- shutdown --------------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Shut every replica down (idempotent); requests in flight fail with EngineDeadError."""
        self._closing = True
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
