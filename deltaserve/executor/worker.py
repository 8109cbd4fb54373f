"""`Worker`: one rank's device, model, cache tensors and model runner (with its sampler)."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch

from deltaserve import envs
from deltaserve.cache.planner import CacheLayout
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.config.speculative import BLOCK_DRAFTERS
from deltaserve.distributed import init_parallel_group
from deltaserve.distributed.eplb import EPLBSettings
from deltaserve.distributed.replica_experts import ReplicaExperts, init_replica_groups
from deltaserve.executor.base import WorkerInfo
from deltaserve.executor.block_sync import BlockDeltaStep, BlockTableReceiver
from deltaserve.executor.shared_store import open_shared_store, shared_namespace
from deltaserve.kvtransfer.transport import TransferServer
from deltaserve.layers.linear import prepack_weights
from deltaserve.models.dspark import load_drafter, resolve_drafter_path
from deltaserve.models.kimi_vision import load_vision_model
from deltaserve.models.loader import load_model
from deltaserve.ops import dispatch
from deltaserve.runner.block_drafting import BlockDrafting
from deltaserve.runner.cuda_graphs import GraphSettings
from deltaserve.runner.cuda_graphs import default_sizes as default_graph_sizes
from deltaserve.runner.encoder_cache import EncoderCache
from deltaserve.runner.image_embedder import ImageEmbedder
from deltaserve.runner.kv_transfer_io import KVTransferIO
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.runner.shared_io import SharedStoreIO
from deltaserve.scheduler.output import RunnerOutput, SchedulerOutput
from deltaserve.utils.cpu_threads import default_num_threads
from deltaserve.utils.host_memory import available_host_bytes
from deltaserve.utils.malloc import keep_freed_memory

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free bytes on `device` (CUDA: the driver's free memory; CPU: the free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


class Worker:
    """Loads the model on its device at construction; `initialize_cache` then builds the runner."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        """`rank` of `config.parallel.world_size` ranks; with several, `distributed_init_method` ('tcp://HOST:PORT',
        chosen by the executor) is where they meet to form their process group."""
        self.config, self.rank = config, rank
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r}, but this torch ({torch.__version__}) sees no CUDA device")
        on_cpu = config.device == "cpu"
        if on_cpu:
            # KDA's decay factors exp(G) underflow into subnormals on long chunks, where x86 arithmetic is many times
            # slower: a 2,048-token prefill spent 1.9x as long in its KDA op. Flushed to zero they change nothing
            # above 1.2e-38 (an MXFP4 value below that, 2**-127 or 1.5 * 2**-127, reads as 0). Set before the thread
            # pool exists where possible: threads inherit the setting from the thread that creates them.
            torch.set_flush_denormal(True)
            if not keep_freed_memory():  # steps reuse their temporaries (utils/malloc.py)
                logger.info("not glibc: malloc left as it is")
        world = config.parallel.world_size
        if config.num_threads is not None or on_cpu:
            # The engine's threads are shared by its ranks (they run at the same time, on the same cores here).
            torch.set_num_threads(max(1, (config.num_threads or default_num_threads()) // world))
        if world > 1 and distributed_init_method is None and config.parallel.expert_replicas is None:
            raise ValueError(f"{world} ranks need a distributed_init_method")
        device = config.device
        if device == "cuda" and world > 1:
            # A GPU per rank: the rank's index among the GPUs this process sees (Ray shows each actor its own as
            # cuda:0; a multiprocess worker sees them all). NCCL needs the current device set before joining.
            device = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        par = config.parallel
        self.replicas: ReplicaExperts | None = None
        """The experts' exchange when they span data-parallel replicas (then every step runs a forward or joins it
        idle: `execute_model`)."""
        if par.expert_replicas is not None:
            self.group, self.replicas = init_replica_groups(par.expert_replicas, rank, world, device)
        else:
            self.group = init_parallel_group(rank, world, distributed_init_method or "", device)
        eplb = EPLBSettings(par.num_redundant_experts, par.eplb_step_interval) if par.enable_eplb else None
        self.model = load_model(config.model, dtype=getattr(torch, config.dtype), device=device,
                                tp=self.group, expert_parallel=par.enable_expert_parallel, eplb=eplb,
                                replicas=self.replicas)
        # The vision tower, beside the language model (replicated on every rank), loaded before the cache is sized so
        # that its weights count as used memory.
        self.vision = load_vision_model(config.model, dtype=getattr(torch, config.dtype), device=device) \
            if ModelConfig.from_pretrained(config.model).vision is not None else None
        backends = dispatch.log_backends()  # which kernels serve each op here, once
        if on_cpu and backends["linear"][0] != dispatch.REF and isinstance(self.model, torch.nn.Module):
            packed = prepack_weights(self.model)
            logger.info("packed %d weight tensors for the oneDNN linear", packed)
        self.device = next(self.model.parameters()).device
        self.runner: ModelRunner | None = None
        self._block_tables = BlockTableReceiver()
        torch.manual_seed(config.seed)  # the shared generator of unseeded sampling
        kv = config.kv_transfer_config
        self.transfer_server: TransferServer | None = None
        if kv is not None and kv.is_producer:
            from deltaserve.kvtransfer.factory import make_server

            self.transfer_server = make_server(kv, rank)
            logger.info("rank %d: kv transfer server at %s", rank, self.transfer_server.address)

    def describe(self) -> WorkerInfo:
        return WorkerInfo(cache_specs=tuple(self.model.cache_specs()),
                          available_memory_bytes=available_memory_bytes(self.device), device=str(self.device),
                          weight_bytes=sum(t.numel() * t.element_size()
                                           for t in itertools.chain(self.model.parameters(), self.model.buffers())),
                          transfer_addresses=() if self.transfer_server is None else (self.transfer_server.address,),
                          decode_graphs=self._decode_graphs())

    def initialize_cache(self, layout: CacheLayout, num_slots: int) -> None:
        self.runner = ModelRunner(self.model, num_blocks=layout.num_blocks, block_size=layout.block_size,
                                  num_slots=num_slots,
                                  max_num_tokens=self.config.scheduler.max_num_batched_tokens,
                                  num_host_blocks=layout.num_host_blocks, num_host_slots=layout.num_host_slots,
                                  overlap_host_copies=envs.host_copy_overlap(),
                                  rejection_sample_method=self._rejection_sample_method(),
                                  graphs=(graphs := self._graph_settings(layout.block_size)))
        if graphs is not None and graphs.capture:
            self.runner.capture_graphs(lambda ok: ok if self.group.size == 1 else self._on_every_rank([ok])[0])
        spec = self.config.speculative_config
        if spec is not None and spec.method in BLOCK_DRAFTERS:
            path = resolve_drafter_path(spec.model, self.config.model)
            self.runner.drafting = BlockDrafting(
                load_drafter(path, dtype=getattr(torch, self.config.dtype), device=self.device), self.model,
                sample_method=spec.draft_sample_method or "probabilistic", seed=self.config.seed,
                compiled=(self.device.type == "cpu" and not self.config.enforce_eager and envs.drafter_graphs()))
            drafting = self.runner.drafting
            weights = sum(p.numel() * p.element_size() for p in drafting.drafter.parameters())
            logger.info("dspark block drafter %s: %d drafts per forward over %d target positions of layers %s; "
                        "weights %.2f MiB, %.1f KiB per sequence (feature window and kept draft distributions)",
                        path, drafting.block_size, drafting.window, list(drafting.drafter.config.tap_layers),
                        weights / 2**20, drafting.bytes_per_request / 2**10)
        if self.vision is not None:
            self.runner.images = ImageEmbedder(self.vision, EncoderCache(self.config.cache.encoder_cache_bytes),
                                             getattr(torch, self.config.dtype))
        store = open_shared_store(self.config)
        if store is not None:
            self.runner.shared = SharedStoreIO(store, self.rank, self.config.parallel.world_size)
        kv = self.config.kv_transfer_config
        if kv is not None:
            from deltaserve.kvtransfer.factory import make_client

            self.runner.transfer = KVTransferIO(
                namespace=shared_namespace(self.config), rank=self.rank, size=self.config.parallel.world_size,
                block_size=layout.block_size, server=self.transfer_server,
                client=make_client(kv) if kv.is_consumer else None, timeout_s=kv.transfer_timeout_s,
                ttl_s=kv.transfer_ttl_s, all_gather=self._all_gather_bytes)

    def _decode_graphs(self, log: bool = False) -> bool:
        """Decode graphs on a GPU unless `enforce_eager` (or their padded eager twin on a CPU when
        `DELTASERVE_CPU_DECODE_GRAPHS` asks); none where a step needs more than the token embeddings and the forward:
        a block drafter (its feature taps are forward hooks), a vision tower (image features), expert parallelism
        (its placement tables are copied from the host every forward; EPLB counts routing on the host)."""
        config = self.config
        if config.enforce_eager or not (self.device.type == "cuda" or envs.cpu_decode_graphs()):
            return False
        spec = config.speculative_config
        drafter = spec is not None and spec.method in BLOCK_DRAFTERS
        par = config.parallel
        if drafter or self.vision is not None or par.enable_expert_parallel or par.enable_eplb:
            if log:
                logger.info("CUDA graphs off: %s", "a block drafter" if drafter
                            else "a vision tower" if self.vision is not None else "expert parallelism")
            return False
        return True

    def _graph_settings(self, block_size: int) -> GraphSettings | None:
        """`GraphSettings` where `_decode_graphs` says so: the configured sizes, the block table of the longest
        sequence (with its proposals), capture on a GPU."""
        if not self._decode_graphs(log=True):
            return None
        config, spec = self.config, self.config.speculative_config
        model_limit = ModelConfig.from_pretrained(config.model).max_model_len
        max_len = min(config.max_model_len or model_limit, model_limit, config.max_seq_len_to_capture)
        proposals = 0 if spec is None else spec.num_speculative_tokens
        sizes = config.cuda_graph_sizes or default_graph_sizes(config.scheduler.max_num_seqs)
        return GraphSettings(sizes=sizes, max_blocks=-(-(max_len + proposals + 1) // block_size),
                             capture=self.device.type == "cuda")

    def _rejection_sample_method(self) -> str:
        spec = self.config.speculative_config
        return "standard" if spec is None or spec.rejection_sample_method is None else spec.rejection_sample_method

    def time_step(self, num_seqs: int, query_len: int, context_len: int) -> float:
        """`ModelRunner.time_step` (start-up measurements of the adaptive verifier)."""
        if self.runner is None:
            raise RuntimeError("time_step before initialize_cache")
        return self.runner.time_step(num_seqs, query_len, context_len)

    def time_draft(self, num_seqs: int) -> float:
        """`BlockDrafting.time_draft`; 0 without a block drafter."""
        if self.runner is None:
            raise RuntimeError("time_draft before initialize_cache")
        return 0.0 if self.runner.drafting is None else self.runner.drafting.time_draft(num_seqs)

    def _all_gather_bytes(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `x`, concatenated in rank order, on the host (through the device when NCCL needs it)."""
        return self.group.all_gather(x.to(self.device), dim=0).cpu()

    def _on_every_rank(self, flags: list[bool]) -> list[bool]:
        """Per flag, whether it is set on every rank (an all-reduce of the ranks that miss it)."""
        missing = torch.tensor([0 if ok else 1 for ok in flags], dtype=torch.int32)
        if self.device.type == "cuda":
            missing = missing.to(self.device)
        self.group.all_reduce(missing)
        return [m == 0 for m in missing.tolist()]

    def close(self) -> None:
        """Release what outlives a step: the transfer server's payloads (shared-memory segments included)."""
        if self.transfer_server is not None:
            self.transfer_server.close()
            self.transfer_server = None

    def execute_model(self, step: SchedulerOutput | BlockDeltaStep) -> RunnerOutput:
        """Run one step: a scheduler output, or one whose block tables are sent as deltas (another process's
        executor). A step without chunks joins the other replicas' expert exchanges when the experts span them."""
        if self.runner is None:
            raise RuntimeError("execute_model before initialize_cache")
        out = self._block_tables.decode(step)
        result = self.runner.execute(out)
        if self.replicas is not None and not out.chunks:
            self.model.idle_experts()
        if self.group.size > 1 and result.shared_fetched:  # an entry is usable only if every rank got its part
            result = dataclasses.replace(result, shared_fetched=self._on_every_rank(result.shared_fetched))
        if self.group.size > 1 and result.transfer is not None and result.transfer.fetched:
            result = dataclasses.replace(result, transfer=dataclasses.replace(
                result.transfer, fetched=self._on_every_rank(result.transfer.fetched)))
        return result
