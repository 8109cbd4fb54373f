"""Engine arguments: cache sizing, scheduling limits, and the root `EngineConfig` that composes them.

Each field is documented once here; `deltaserve ... --help` is generated from these docstrings.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from deltaserve import envs
from deltaserve.config.dp_experts import ExpertReplicas
from deltaserve.config.fields import check_field_types
from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.config.speculative import BLOCK_DRAFTERS, SpeculativeConfig

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(text: str | int | float, available_bytes: int, name: str = "cache_memory") -> int:
    """'2GiB', '512MB', '1000000' (bytes) or a fraction in (0, 1] of `available_bytes` -> bytes. ValueError naming
    the field `name` for anything else, zero included."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        text = str(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{name}={text!r}: expected bytes ('2GiB', '512MB', '1000000') or a fraction like 0.5")
    value, unit = float(m.group(1)), m.group(2).upper()
    if not unit and value <= 1.0 and "." in m.group(1):
        return int(value * available_bytes)
    return int(value * _UNITS[unit])


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """How much memory the MLA KV blocks and KDA state slots get, and how it is split."""

    block_size: int = 16
    """Tokens per MLA KV block."""
    cache_memory: str | float = field(default_factory=envs.cache_memory)
    """Memory for both pools: bytes ('2GiB', '512MB', or a number) or a fraction of free memory ('0.5', or a float
    up to 1.0). Default: $DELTASERVE_CACHE_MEMORY, else '2GiB'."""
    num_blocks: int | None = None
    """Override the planner: exactly this many KV blocks."""
    num_state_slots: int | None = None
    """Override the planner: exactly this many KDA state slots (concurrent sequences)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks and KDA state checkpoints across requests that share a prompt prefix."""
    state_checkpoint_interval: int = 512
    """During a long prefill, save a KDA state checkpoint every this many tokens (a multiple of block_size)."""
    checkpoint_memory: str | float = "0.25"
    """Memory for prefix-cache state checkpoints: bytes ('512MiB') or a fraction of cache_memory ('0.25')."""
    num_checkpoint_slots: int | None = None
    """Override: exactly this many state checkpoint slots (0 keeps no checkpoints)."""
    host_cache_memory: str | float | None = None
    """Host memory for the prefix cache's host tier (L2), per rank: KV blocks and state checkpoints evicted from the
    device go there instead of being dropped, and come back on a hit. Bytes ('8GiB') or a fraction of free host
    memory ('0.25'); its checkpoint share is checkpoint_memory's fraction. None: no host tier."""
    kv_offloading_size: float | None = None
    """vLLM's name for the host tier's size, in GiB (host_cache_memory='<N>GiB')."""
    shared_cache_url: str | None = None
    """A shared store (L3) of KV blocks and state checkpoints that several engines and restarts see:
    'redis://HOST:PORT[/DB]' or 'mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata'. Computed prefixes
    are written through to it; a prefix found there is fetched into the host tier (512MiB unless
    host_cache_memory says otherwise) before its request starts. A failing store is a miss, never an error."""
    shared_cache_timeout_s: float = 1.0
    """The most one shared-store call waits before it counts as a miss."""
    encoder_cache_memory: str | int = "512MiB"
    """Memory for the encoder cache, per rank: projected image features by image content hash, reused by later
    prefill chunks and later requests with the same image. Bytes ('512MiB'); 0 keeps none (the vision tower then
    runs for every chunk that covers an image)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.state_checkpoint_interval < 1 or self.state_checkpoint_interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval={self.state_checkpoint_interval} must be a positive "
                             f"multiple of block_size={self.block_size}")
        if self.num_checkpoint_slots is not None and self.num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {self.num_checkpoint_slots}")
        for name in ("num_blocks", "num_state_slots"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        parse_memory(self.cache_memory, 1)  # the syntax, checked here rather than in the engine process
        parse_memory(self.checkpoint_memory, 1, "checkpoint_memory")
        if self.kv_offloading_size is not None:
            if self.host_cache_memory is not None:
                raise ValueError("give host_cache_memory or kv_offloading_size, not both")
            if not self.kv_offloading_size > 0:
                raise ValueError(f"kv_offloading_size must be > 0 (GiB), got {self.kv_offloading_size}")
            object.__setattr__(self, "host_cache_memory", f"{self.kv_offloading_size}GiB")
        if self.shared_cache_url is not None:
            if not self.shared_cache_url.startswith(("redis://", "mooncake://")):
                raise ValueError(f"shared_cache_url={self.shared_cache_url!r}: expected redis://HOST:PORT or "
                                 "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata")
            if self.host_cache_memory is None:
                object.__setattr__(self, "host_cache_memory", "512MiB")  # where fetched entries land
        if not self.shared_cache_timeout_s > 0:
            raise ValueError(f"shared_cache_timeout_s must be > 0, got {self.shared_cache_timeout_s}")
        if self.host_cache_memory is not None:
            parse_memory(self.host_cache_memory, 1, "host_cache_memory")
        self.encoder_cache_bytes  # noqa: B018 (checks the syntax now)

    @property
    def encoder_cache_bytes(self) -> int:
        """`encoder_cache_memory` in bytes."""
        if str(self.encoder_cache_memory).strip() == "0":
            return 0
        value = parse_memory(self.encoder_cache_memory, 0, "encoder_cache_memory")
        if value == 0:  # a fraction (of no memory in particular)
            raise ValueError(f"encoder_cache_memory={self.encoder_cache_memory!r}: expected bytes ('512MiB') or 0")
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits and the queue policy."""

    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes, prefill chunks); long prompts are chunked to fit."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    policy: str = "fcfs"
    """Waiting-queue order: 'fcfs' (arrival) or 'priority' (lower value first, then arrival)."""
    watchdog_timeout_s: float = 60.0
    """Log an error when requests are pending but none made progress for this long."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={self.policy!r} is not supported (supported: 'fcfs', 'priority')")
        if not self.watchdog_timeout_s > 0:  # NaN too
            raise ValueError(f"watchdog_timeout_s must be > 0, got {self.watchdog_timeout_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """How the model is split over worker ranks (tensor / expert parallelism inside one engine replica) and how many
    replicas serve (data parallelism). vLLM's names."""

    tensor_parallel_size: int = 1
    """Worker ranks one replica's model is sharded over (attention heads, MLP and expert widths, vocabulary)."""
    data_parallel_size: int = 1
    """Engine replicas (each with `tensor_parallel_size` ranks) behind one API server and its router."""
    enable_expert_parallel: bool = False
    """Partition the routed experts over the ranks (each rank holds whole experts) instead of sharding every
    expert's width: over the tensor-parallel ranks, and with data_parallel_size > 1 over every rank of every replica
    (attention stays data-parallel; the replicas step in lockstep and exchange tokens in each MoE layer)."""
    distributed_executor_backend: str | None = None
    """Where the worker ranks run: 'uni' (in the engine process; one rank only), 'mp' (a process per rank on this
    machine) or 'ray' (a Ray actor per rank in a placement group). Default: 'uni' for one rank, 'mp' otherwise."""
    ray_address: str | None = None
    """Ray cluster to join with the 'ray' backend ('auto', 'HOST:PORT' or 'ray://HOST:PORT'); none: $RAY_ADDRESS,
    else a local Ray instance started for this engine."""
    enable_eplb: bool = False
    """Expert-parallel load balancing: count the tokens routed to each expert and place redundant copies of the hot
    ones (needs enable_expert_parallel)."""
    num_redundant_experts: int = 0
    """Extra expert copies over all ranks with enable_eplb (their number plus the experts' is a multiple of the
    ranks)."""
    eplb_step_interval: int = 3000
    """Engine steps between two rebalancings with enable_eplb."""
    load_balance_method: str = "session_affinity"
    """How the data-parallel router picks a replica: 'session_affinity' (a request whose session id or prompt
    prefix a replica has served goes back to it, others to the least loaded) or 'least_loaded'."""
    expert_replicas: ExpertReplicas | None = field(default=None, metadata={"cli": False})
    """One replica's place among replicas whose experts form one group (set by the data-parallel client)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("tensor_parallel_size", "data_parallel_size", "eplb_step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in ("uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported "
                             "(supported: 'uni', 'mp', 'ray')")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                             f"{self.tensor_parallel_size}: use 'mp' or 'ray'")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb")
        if self.load_balance_method not in ("session_affinity", "least_loaded"):
            raise ValueError(f"load_balance_method={self.load_balance_method!r} is not supported "
                             "(supported: 'session_affinity', 'least_loaded')")
        if self.experts_span_replicas and self.executor_backend == "ray":
            raise ValueError("enable_expert_parallel with data_parallel_size > 1 (experts over every replica's "
                             "ranks) runs with distributed_executor_backend 'mp' or 'uni', not 'ray'")

    @property
    def world_size(self) -> int:
        """Worker ranks of one replica (the tensor-parallel size; expert parallelism uses the same ranks)."""
        return self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        """`distributed_executor_backend`, its default resolved: 'uni' for one rank, 'mp' for several."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def experts_span_replicas(self) -> bool:
        """Whether the routed experts are partitioned over the ranks of several data-parallel replicas (at the
        data-parallel client: `data_parallel_size > 1`; in a replica: `expert_replicas` is set)."""
        return self.enable_expert_parallel and (self.data_parallel_size > 1 or self.expert_replicas is not None)

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are partitioned over (1: every rank holds a slice of every expert)."""
        if not self.enable_expert_parallel:
            return 1
        replicas = self.expert_replicas.size if self.expert_replicas is not None else self.data_parallel_size
        return self.tensor_parallel_size * replicas


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Everything the engine needs; each component receives only its own sub-config."""

    model: str
    """Checkpoint directory."""
    dtype: str = "float32"
    """Weights and activations: 'float32' or 'bfloat16' (router, gates and KDA state stay fp32); 'float64' for
    exactness checks (slow)."""
    max_model_len: int | None = None
    """Cap on prompt + output tokens (default: the model's own limit)."""
    seed: int = 0
    """Seed of the generator shared by unseeded sampling requests."""
    device: str = "cpu"
    """Where the weights, caches and model steps live: 'cpu', 'cuda' or 'cuda:N'."""
    num_threads: int | None = None
    """torch intra-op threads of the engine (default: torch's choice, one per core). On a small shared CPU host, 1
    can be much faster than oversubscribing the cores with the API process."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (vLLM's `--enforce-eager`) nor compile the dspark drafter's graphs on a CPU
    (`runner/drafter_graphs.py`); the target's CPU steps are eager anyway."""
    cuda_graph_sizes: tuple[int, ...] | None = None
    """Decode batch sizes captured as CUDA graphs on a GPU (vLLM's `--cuda-graph-sizes`); a step of n sequences
    replays the smallest size >= n. None: 1, 2, 4 and every multiple of 8 up to max_num_seqs (at most 512)."""
    max_seq_len_to_capture: int = 8192
    """Longest sequence (tokens) a decode graph covers (vLLM's `--max-seq-len-to-capture`): a step with a longer one
    runs eagerly. Graphs are captured for block tables this wide, and the MLA decode kernel's split-KV grid grows
    with it, whatever the real contexts."""
    structured_output_backend: str = "llguidance"
    """Library that compiles structured-output constraints (JSON schema, regex, Lark grammar) into token masks:
    'llguidance' (default) or 'xgrammar' (optional, not installed by default; no Lark grammars)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (`--speculative-config` JSON, vLLM's keys); none: plain decoding."""
    kv_transfer_config: KVTransferConfig | None = None
    """Prefill/decode disaggregation (`--kv-transfer-config` JSON, vLLM's keys): this instance's role and transport.
    A decode instance fetches transferred prefixes into the host tier (512MiB unless host_cache_memory says
    otherwise); both sides need prefix caching."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"dtype={self.dtype!r} is not supported (supported: 'bfloat16', 'float32', 'float64')")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r} is not supported (supported: 'cpu', 'cuda', 'cuda:N')")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_seq_len_to_capture < 1:
            raise ValueError(f"max_seq_len_to_capture must be >= 1, got {self.max_seq_len_to_capture}")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(self.cuda_graph_sizes)
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))
        if self.structured_output_backend not in ("llguidance", "xgrammar"):
            raise ValueError(f"structured_output_backend={self.structured_output_backend!r} is not supported "
                             "(supported: 'llguidance', 'xgrammar')")
        spec = self.speculative_config
        if (self.parallel.experts_span_replicas and spec is not None and spec.method in BLOCK_DRAFTERS
                and spec.enable_adaptive_verification):
            # its start-up timing steps run on one replica alone, but each forward exchanges with every replica
            raise ValueError("adaptive verification (speculative_config.enable_adaptive_verification) cannot run with "
                             "expert parallelism over data-parallel replicas: set it to false")
        kv = self.kv_transfer_config
        if kv is not None:
            if not self.cache.enable_prefix_caching:
                raise ValueError("kv_transfer_config needs enable_prefix_caching: the transferred blocks and state "
                                 "enter the prefix cache")
            if kv.is_consumer and self.cache.host_cache_memory is None:  # where fetched caches land
                object.__setattr__(self, "cache", dataclasses.replace(self.cache, host_cache_memory="512MiB"))
