"""`RayExecutor`: one Ray actor per rank, placed by a placement group, so that a replica's ranks can span machines.

Cluster: the one at `ParallelConfig.ray_address`, else at $RAY_ADDRESS (`ray start --head` on one node, `ray start
--address HEAD:PORT` on the others), else a local Ray instance started for this engine (no dashboard, a small
object store) and stopped with it. If this process is already connected to Ray, that connection is used and left
as it is.

Placement: a placement group of one bundle per rank ({"CPU": 1}, or {"GPU": 1} on CUDA), rank r in bundle r, with
strategy "PACK": the bundles go on as few nodes as possible, a node filled before the next is used, and the ranks
that do not fit on one node land on the next (STRICT_PACK would refuse them). With 8 GPUs per node, 16 ranks take
two nodes, 8 ranks each (which ranks share a node is Ray's choice; the start-up log names each rank's node). Each
actor gets its own GPU from Ray (CUDA_VISIBLE_DEVICES), which it sees as device 'cuda'.

Rendezvous: the rank-0 actor reports its node's IP address and a port free there; every rank's `Worker` joins the
torch.distributed group at 'tcp://IP:PORT' (gloo on a CPU, NCCL on CUDA).

Calls: as in `multiproc.py`, each call is pickled once and sent to every rank; every rank answers
(rank 0 with the result), answers are taken as they come, and a dead actor raises `WorkerDiedError` naming its rank
at once, whichever rank it is. An exception in a worker is `WorkerError` (the worker lives on) with its traceback.

Ray is imported when the executor is built, never by `import deltaserve.executor`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import traceback
from typing import TYPE_CHECKING, Any

from deltaserve import envs
from deltaserve.config import EngineConfig
from deltaserve.executor.base import BroadcastExecutor, WorkerDiedError, WorkerInfo
from deltaserve.executor.multiproc import WorkerError, free_port

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""How long joining a cluster waits for its address to answer before failing (Ray itself retries for minutes)."""
PLACEMENT_TIMEOUT_S = 120.0
"""How long the placement group may wait for its bundles (resources held by other jobs, nodes still joining)."""
INLINE_CALL_BYTES = 100 * 2**10
"""A call this large or smaller travels inside each actor's task (Ray's own limit for inlined arguments); a larger
one is put in the object store once and read from there by every rank. `ray.put` for every call measured 3.3 ms
per round trip to 2 actors against 1.5 ms inlined, here."""
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20
"""Object store of a local Ray instance (Ray's minimum is 75 MiB): it carries one scheduler output per step."""

_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""HTTP/2's client preface and an empty SETTINGS frame: a Ray GCS (a gRPC server) answers with a SETTINGS frame."""


class RayWorker:
    """The body of one rank's Ray actor: builds the rank's `Worker` and runs the calls sent to it."""

    def __init__(self, rank: int, log_level: int) -> None:
        self.rank = rank
        if not logging.getLogger().handlers:
            logging.basicConfig(level=log_level,
                                format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
        self.worker: Any = None

    def identify(self) -> tuple[str, Any, str]:
        """(this process id, this node's IP address, a TCP port free on that address now: rank 0's is where the
        ranks' process group meets), answered as `call` does."""
        import ray

        ip = ray.util.get_node_ip_address()
        return "ok", (os.getpid(), ip, free_port(ip)), ""

    def start(self, config: EngineConfig, init_method: str | None) -> tuple[str, Any, str]:
        """Build this rank's `Worker` (its shard of the model). Answers as `call` does, with what it loaded."""
        try:
            from deltaserve.executor.worker import Worker  # torch and the model stack, in the actor's process only

            self.worker = Worker(config, self.rank, init_method)
            return "ok", self.worker.describe(), ""
        except Exception as e:
            logger.exception("worker %d start-up failed", self.rank)
            return "error", f"{type(e).__name__}: {e}", traceback.format_exc()

    def call(self, request: bytes) -> tuple[str, Any, str]:
        """Run `Worker.<method>(*args)` for `request` = pickled (method, args). Answers ('ok', result, '') (the
        result on rank 0, None on the others: every rank answers) or ('error', message, traceback): the worker
        lives on."""
        method, args = pickle.loads(request)
        try:
            result = getattr(self.worker, method)(*args)
        except Exception as e:  # the step failed on this rank; the engine decides what that ends
            logger.exception("worker %d: %s failed", self.rank, method)
            return "error", f"{type(e).__name__}: {e}", traceback.format_exc()
        return "ok", result if self.rank == 0 else None, ""


class RayExecutor(BroadcastExecutor):
    """`world_size` Ray actors, one per rank, each loading its shard of the model."""

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.world_size
        self._actors: list[Any] = []
        """Ray actor handles of `RayWorker`, by rank."""
        self._group: PlacementGroup | None = None
        self._closed = False
        self._broken: str | None = None
        """Why the workers can no longer be used (an actor died); `shutdown` still stops the others."""
        self.pids: list[int] = []
        """The actors' process ids, by rank."""
        self.nodes: list[str] = []
        """The IP address of each rank's node, by rank."""
        self._owns_ray = connect(config.parallel.ray_address or envs.ray_address(), self.world_size)
        try:
            on_cuda = config.device.startswith("cuda")
            self._group = place(self.world_size, "GPU" if on_cuda else "CPU")
            self._actors = self._start_actors(self._group, on_cuda)
            identities = self._gather([actor.identify.remote() for actor in self._actors])
            self.pids = [pid for pid, _, _ in identities]
            self.nodes = [ip for _, ip, _ in identities]
            _, ip, port = identities[0]
            init_method = f"tcp://{_host_in_url(ip)}:{port}" if self.world_size > 1 else None
            if on_cuda:  # Ray gives each actor its own GPU (CUDA_VISIBLE_DEVICES): it is the actor's device 0
                config = dataclasses.replace(config, device="cuda")
            self._infos: list[WorkerInfo] = self._gather([a.start.remote(config, init_method) for a in self._actors])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray actor(s) ready: pids %s on nodes %s%s", self.world_size, self.pids, self.nodes,
                    f", rendezvous {init_method}" if init_method else "")

    # -- the Executor protocol -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, and stop Ray if this executor started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        for actor in self._actors:
            with contextlib.suppress(Exception):  # already dead, or Ray already gone
                ray.kill(actor, no_restart=True)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
        if self._owns_ray:
            ray.shutdown()

    # -- internals -----------------------------------------------------------------------------------------------

    def _start_actors(self, group: PlacementGroup, on_cuda: bool) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # A cluster's actors start with the environment of its `ray start`, on other machines: pass ours on.
        env_vars = envs.deltaserve_variables()
        options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if on_cuda else {"num_cpus": 1}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        actor_class = ray.remote(max_restarts=0)(RayWorker)
        log_level = logging.getLogger("deltaserve").getEffectiveLevel()
        return [actor_class.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                         placement_group_bundle_index=rank),
                    **options).remote(rank, log_level)
                for rank in range(self.world_size)]

    def _call(self, method: str, *args: Any) -> Any:
        """Send one call to every rank; rank 0's result once every rank has answered."""
        import ray

        if self._closed or self._broken is not None:
            raise WorkerDiedError(self._broken or "the workers were shut down")
        request: Any = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank
        if len(request) > INLINE_CALL_BYTES:  # else Ray would copy it into its object store once per rank
            request = ray.put(request)  # (an ObjectRef argument reaches the actor as its value)
        return self._gather([actor.call.remote(request) for actor in self._actors])[0]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """One answer per ref (by rank, as `RayWorker.call` gives them), taken as they come: a dead actor raises
        WorkerDiedError at once; a worker's exception is raised as WorkerError (the lowest failing rank's) once
        every rank has answered, so that no answer is left behind."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: dict[int, WorkerError] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                status, value, trace = ray.get(ready[0])
            except RayActorError as e:
                raise self._died(rank, e) from None
            except RayTaskError as e:  # Ray's own failure to run the call (e.g. to deserialise it)
                cause = e.cause if isinstance(e.cause, BaseException) else e
                status, value, trace = "error", f"{type(cause).__name__}: {_first_line(cause)}", str(e)
            if status == "error":
                errors[rank] = WorkerError(f"worker {rank}: {value}", trace)
            results[rank] = value
        if errors:
            raise errors[min(errors)]
        return results

    def _died(self, rank: int, e: Exception) -> WorkerDiedError:
        where = f" (pid {self.pids[rank]} on {self.nodes[rank]})" if self.pids else ""
        self._broken = f"the Ray actor of worker {rank}{where} died: {_first_line(e)}"
        return WorkerDiedError(self._broken)


def import_ray() -> Any:
    """The `ray` module, or a one-line ValueError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                         "pip install 'deltaserve[ray]'") from None
    return ray


def connect(address: str | None, world_size: int) -> bool:
    """Connect this process to Ray: the cluster at `address` ('auto', 'HOST:PORT', or 'ray://HOST:PORT' with
    `ray[client]` installed), or a new local instance when `address` is None or 'local'. True when this call
    connected (so `shutdown` disconnects, which for a local instance stops it); False when the process was
    connected already. A cluster that does not answer within `CONNECT_TIMEOUT_S`, or refuses us, is a one-line
    ConnectionError naming the address."""
    ray = import_ray()
    if ray.is_initialized():
        logger.info("Ray is already initialised in this process: using its cluster")
        return False
    if address is None or address == "local":
        # Logical CPUs: a rank per CPU bundle even where there are fewer cores (ranks then share them).
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, logging_level=logging.WARNING)
        logger.info("started a local Ray instance for %d rank(s)", world_size)
        return True
    if address != "auto":
        check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        detail = _first_line(e)
        if "uthentication" in repr(e.__cause__) + detail:
            detail += ("; the cluster uses token authentication: set RAY_AUTH_MODE=token and its token "
                       "(~/.ray/auth_token or RAY_AUTH_TOKEN)")
        raise ConnectionError(f"could not join the Ray cluster at {address}: {detail}") from None
    logger.info("joined the Ray cluster at %s: %s", address, ray.cluster_resources())
    return True


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise a one-line ConnectionError unless a gRPC server (a Ray GCS, or a Ray Client server for 'ray://')
    answers at `address` within `timeout_s`: `ray.init` would otherwise retry for minutes."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(_HTTP2_PREFACE)
            frame = sock.recv(9)
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None
    if len(frame) < 9 or frame[3] != 4:  # a SETTINGS frame: type 4
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: something answers there, but not Ray")


def split_address(address: str) -> tuple[str, int]:
    """'HOST:PORT', '[IPv6]:PORT' or 'ray://HOST:PORT' -> (host, port); a ValueError naming it otherwise."""
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address={address!r} is not 'auto', 'HOST:PORT' or 'ray://HOST:PORT'")
    return host, int(port)


def place(world_size: int, resource: str) -> PlacementGroup:
    """A ready placement group of `world_size` bundles of {resource: 1}, strategy PACK; a one-line RuntimeError
    when the cluster has fewer such resources, or they do not come free within `PLACEMENT_TIMEOUT_S`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources().get(resource, 0)
    if total < world_size:
        raise RuntimeError(f"{world_size} rank(s) need {world_size} {resource}(s), but the Ray cluster has {total:g} "
                           f"(its resources: {ray.cluster_resources()})")
    group = placement_group([{resource: 1}] * world_size, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster did not free {world_size} {resource}(s) for the ranks within "
                           f"{PLACEMENT_TIMEOUT_S:g} s (available now: {ray.available_resources()})") from None
    return group


def _host_in_url(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
