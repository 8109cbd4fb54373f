"""The only place deltaserve reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def api_key() -> str | None:
    """`DELTASERVE_API_KEY`: the bearer key the server requires when `--api-key` is not given."""
    return os.environ.get("DELTASERVE_API_KEY") or None


def client_api_key() -> str | None:
    """The key benchmark clients send: `DELTASERVE_API_KEY`, else `OPENAI_API_KEY` (what `vllm bench serve`
    reads). Ours first, so that a real OpenAI key in the environment is not sent to a local server."""
    return api_key() or os.environ.get("OPENAI_API_KEY") or None


def cache_memory() -> str:
    """`DELTASERVE_CACHE_MEMORY`: the default of `--cache-memory` (`CacheConfig.cache_memory`, in any form it
    takes: '2GiB', '512MiB', '0.5'); '2GiB' when unset. Like vLLM's `VLLM_CPU_KVCACHE_SPACE`: it sizes every
    engine a host starts, servers and workers included, without a flag each (the test suite sets it: a tiny engine's
    2 GiB of zeroed cache cost more than a second to allocate, hundreds of times)."""
    return os.environ.get("DELTASERVE_CACHE_MEMORY", "").strip() or "2GiB"


def mxfp8_activations() -> bool:
    """`DELTASERVE_MXFP8_ACTIVATIONS=1`: round the inputs of MXFP4 expert GEMMs through MXFP8 (E4M3 with an E8M0
    scale per 32), emulating an MXFP4 x MXFP8 kernel (model-spec §10.4). Off by default (bf16/fp32 activations)."""
    return os.environ.get("DELTASERVE_MXFP8_ACTIVATIONS", "").strip().lower() in ("1", "true", "yes", "on")


def host_copy_overlap() -> bool | None:
    """`DELTASERVE_HOST_COPY_OVERLAP`: `1` runs the host tier's copies beside the forward, layer by layer, `0` all
    before it (the reference); unset: beside it on a GPU (a copy stream), before it on a CPU (where a copy thread
    only competes with the forward for the same cores and memory: measured slower on 2 cores)."""
    value = os.environ.get("DELTASERVE_HOST_COPY_OVERLAP", "").strip().lower()
    return None if not value else value not in ("0", "false", "no", "off")


def triton_interpret() -> bool:
    """`TRITON_INTERPRET=1` (Triton's own variable): kernels run in Triton's interpreter, on the CPU (tests)."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def native_kernels() -> bool:
    """`DELTASERVE_NATIVE_KERNELS=0` turns the CPU's C kernels off (`deltaserve.ops.native_backend`): their ops then
    run their PyTorch backends. On by default where a C compiler is found."""
    return os.environ.get("DELTASERVE_NATIVE_KERNELS", "").strip().lower() not in ("0", "false", "no", "off")


def native_cache_dir() -> Path:
    """`DELTASERVE_NATIVE_CACHE`: where the C kernels are built to (default `$XDG_CACHE_HOME/deltaserve/native`, or
    `~/.cache/deltaserve/native`)."""
    value = os.environ.get("DELTASERVE_NATIVE_CACHE", "").strip()
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "deltaserve" / "native"


def drafter_graphs() -> bool:
    """`DELTASERVE_DRAFTER_GRAPHS=0` keeps the block drafter's forward eager on a CPU (`runner/drafter_graphs.py`);
    on by default (`--enforce-eager` also turns it off)."""
    return os.environ.get("DELTASERVE_DRAFTER_GRAPHS", "").strip().lower() not in ("0", "false", "no", "off")


def compile_cache_dir() -> Path:
    """`DELTASERVE_COMPILE_CACHE`: where ahead-of-time compiled graphs are kept between runs (default
    `$XDG_CACHE_HOME/deltaserve/compiled`, or `~/.cache/deltaserve/compiled`)."""
    value = os.environ.get("DELTASERVE_COMPILE_CACHE", "").strip()
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "deltaserve" / "compiled"


def cpu_decode_graphs() -> bool:
    """`DELTASERVE_CPU_DECODE_GRAPHS=1`: on a CPU, run pure-decode steps as a CUDA graph replay would, padded to the
    capture sizes on static buffers (`deltaserve.runner.cuda_graphs`), without capturing: the eager twin of a
    replay, for tests. Off by default (padding only costs a CPU time)."""
    return os.environ.get("DELTASERVE_CPU_DECODE_GRAPHS", "").strip().lower() in ("1", "true", "yes", "on")


def ops_backend() -> str:
    """`DELTASERVE_OPS_BACKEND`: forces op backends (parsed by `deltaserve.ops.dispatch`): `ref` for every op, or
    per op `kda_prefill=ref,mla_decode=flash`. Empty by default (each op picks its first capable backend)."""
    return os.environ.get("DELTASERVE_OPS_BACKEND", "").strip()


def cuda_visible_devices() -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as a list of device ids (None when unset): the GPUs data-parallel replicas are placed
    on, `tensor_parallel_size` each, in order."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]


def ray_address() -> str | None:
    """`RAY_ADDRESS` (Ray's own variable): the cluster the 'ray' executor joins when `--ray-address` is not given."""
    return os.environ.get("RAY_ADDRESS") or None


def deltaserve_variables() -> dict[str, str]:
    """Every `DELTASERVE_*` variable set here: what the Ray executor passes on to its actors, which start with the
    environment of their node's `ray start`, possibly on another machine."""
    return {name: value for name, value in os.environ.items() if name.startswith("DELTASERVE_")}
