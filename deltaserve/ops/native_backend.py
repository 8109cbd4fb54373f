"""Small C kernels for the CPU (`ops/*/native.c`): compiled on first use with the system C compiler, cached, loaded
with ctypes. No torch headers (a build takes about a second, not a minute) and no Python build step: where there is
no compiler, or the build fails, or `DELTASERVE_NATIVE_KERNELS=0`, the ops keep their PyTorch backends (one log line).

The kernels are plain loops compiled with `-ffp-contract=off` (no fused multiply-adds the compiler picks by context),
so one kernel gives a row the same bits whatever else is in the batch: the decode and the speculative-verify ops of
a family share one kernel, which is what makes verification exact. Built with `-march=native` into a cache keyed by
the source, the flags, the compiler and this CPU's feature flags.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from deltaserve import envs

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp")
"""`-fno-math-errno` lets expf/sqrtf inline (it changes no result); `-fopenmp` for the kernels that split work over
threads (each unit of work is computed by one thread, so the thread count changes no result)."""
HEADERS = Path(__file__).parent
"""Where the kernels' shared headers are (`native_bf16.h`): on the include path, and part of every library's key."""


def compiler() -> str | None:
    """The C compiler to build with (`CC`, else `cc` or `gcc` on PATH), None when there is none."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        path = shutil.which(name)
        if path:
            return path
    return None


def available() -> bool:
    """Native kernels may be built here: a CPU build of torch on Linux with a C compiler, not turned off."""
    return envs.native_kernels() and platform.system() == "Linux" and compiler() is not None


@functools.cache
def load(source: str) -> ctypes.CDLL | None:
    """The compiled library of `source` (a path to a .c file), built on first use; None (logged once) when it cannot
    be built or loaded here."""
    cc = compiler()
    if not available() or cc is None:
        return None
    path = Path(source)
    try:
        return ctypes.CDLL(str(_build(cc, path)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native kernel %s not built (%s): its ops use their PyTorch backends", path.name, exc)
        return None


def function(source: str, name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The C function `name` of `source`'s library (`load`), with its argument types set and an int result; None
    where the library is not built here."""
    lib = load(source)
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


def _build(cc: str, source: Path) -> Path:
    """Compile into the cache (atomically: processes building the same library at once each write their own file and
    rename it into place) and return the library's path."""
    code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(HEADERS.glob("*.h")))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([code, " ".join(FLAGS).encode(), version.encode(), _cpu_flags()])).hexdigest()
    target = envs.native_cache_dir() / f"{source.parent.name}_{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, f"-I{HEADERS}", str(source), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{Path(cc).name} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built native kernel %s (%s)", source.name, target)
    return target


def _cpu_flags() -> bytes:
    """This CPU's feature flags (the library is built for it: -march=native)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    """A contiguous CPU tensor's data pointer, for a kernel argument."""
    return ctypes.c_void_p(t.data_ptr())


def int64s(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of `values` (kept alive by the caller while the kernel runs)."""
    return torch.tensor(values, dtype=torch.int64)


Chunks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""What the recurrent kernels take to describe their rows: (slots [S], cu [S + 1], scratch slots flat, scratch_cu
[S + 1]), host int64 tensors: chunk s owns rows cu[s]..cu[s+1] and state slot slots[s], and after its token t its
state is also copied to scratch[scratch_cu[s] + t] while t < scratch_cu[s+1] - scratch_cu[s]."""


def decode_chunks(num_rows: int, state_indices: torch.Tensor | slice) -> Chunks:
    """Decode rows as chunks of one token each (no scratch), for a decode op's slots (a tensor or a slice)."""
    if isinstance(state_indices, slice):
        start = state_indices.start or 0
        slots = torch.arange(start, start + num_rows, dtype=torch.int64)
    else:
        slots = state_indices.to(dtype=torch.int64).contiguous()
    return (slots, torch.arange(num_rows + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
            torch.zeros(num_rows + 1, dtype=torch.int64))


def verify_chunks(state_indices: torch.Tensor, cu_seqlens: Sequence[int],
                  scratch_slots: Sequence[Sequence[int]]) -> Chunks:
    """A verify op's chunks (its `state_indices`, `cu_seqlens` and `scratch_slots`) as the kernels take them."""
    scratch_cu = [0]
    for saved in scratch_slots:
        scratch_cu.append(scratch_cu[-1] + len(saved))
    return (state_indices.to(dtype=torch.int64).contiguous(), int64s(list(cu_seqlens)),
            int64s([slot for saved in scratch_slots for slot in saved]), int64s(scratch_cu))
