"""A CUDA device emulated on the CPU, for checking device placement where no GPU is lent.

Inside `emulated_cuda()` a CPU-only torch accepts ``device="cuda"``: such tensors are `EmuTensor`s that report
``cuda:0`` and hold CPU data. Every aten op checks its tensor arguments the way a CUDA build does and raises
`DeviceMismatchError` otherwise, then runs on the CPU data: one device per op, except CPU 0-dim tensors as scalars
of elementwise ops, CPU index tensors of the indexing ops, copies across devices, and factories given a CPU
template; a generator must be on its op's device; there is one GPU, cuda:0. So the engine can run end to end with
``device="cuda"``, every tensor that a missing ``device=`` would leave on the CPU shows up as an error, and the
numbers are those of a CPU run. It also counts device-to-host copies (each a stream sync on a GPU): explicit ones
(`.item()`, `.tolist()`, `.cpu()`) and those inside CUDA kernels that size their output on the host (nonzero,
boolean-mask indexing, bincount, unique, repeat_interleave without output_size, grouped_mm outside bf16 on
sm90 / sm100).

What it cannot see: CUDA kernels missing for a dtype, GPU numerics, memory, speed, and syncs it does not list.
Left behind in the process after the context: the fake CUDA device guard stays registered, and torch's C++ flag
that CUDA was initialised stays set (so a later ``torch.empty(device="cuda")`` fails with NotImplementedError
rather than "Torch not compiled with CUDA enabled"). Tests that care about either should run in a subprocess.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_GENERATOR = torch.Generator  # patched inside emulated_cuda()
_ATEN = torch.ops.aten
_TRANSFERS = (_ATEN._to_copy.default, _ATEN.copy_.default)  # the ops that may take two devices
_INDEXING = (_ATEN.index.Tensor, _ATEN.index_put.default, _ATEN.index_put_.default, _ATEN._index_put_impl_.default)


class DeviceMismatchError(RuntimeError):
    """An op got tensors (or a generator) on two devices, which a CUDA build rejects."""


class EmuTensor(torch.Tensor):
    """A tensor that says it is on ``cuda:0`` and keeps its data in a CPU tensor, `inner`."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmuTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=CUDA, requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"EmuTensor({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on an EmuTensor outside emulated_cuda()")


class EmuGenerator(_GENERATOR):
    """`torch.Generator` inside emulated_cuda(): a CPU generator that remembers it was asked for the device."""

    def __new__(cls, device: object = "cpu") -> EmuGenerator:
        return _GENERATOR.__new__(cls)

    def __init__(self, device: object = "cpu") -> None:
        super().__init__()
        self.emulated = _is_cuda(device)


@dataclass
class EmulationStats:
    """What the emulated device saw."""

    device_to_host: int = 0
    """Copies from the device to the host (`.item()`, `.tolist()`, `.cpu()`, ...): each waits for the GPU."""
    ops: int = 0
    ops_by_name: dict[str, int] = field(default_factory=dict)


def _is_cuda(device: object) -> bool:
    return device is not None and not isinstance(device, torch.dtype) and torch.device(device).type == "cuda"


class _Dispatch(TorchDispatchMode):
    """Unwraps EmuTensors, checks devices, runs the op on the CPU data, wraps results that live on the device."""

    def __init__(self, stats: EmulationStats, capability: tuple[int, int]) -> None:
        super().__init__()
        self.stats, self.capability = stats, capability

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        self.stats.ops += 1
        name = func.overloadpacket.__name__
        if name in _METADATA_INPLACE and args and isinstance(args[0], EmuTensor):
            raise NotImplementedError(f"{func}: in-place metadata ops would desync the wrapper from its data")
        target = kwargs.get("device")
        to_device = _is_cuda(target)
        if to_device and torch.device(target).index not in (None, 0):
            raise DeviceMismatchError(f"{func}: the emulated machine has one GPU, cuda:0; asked for {target}")
        devices = _devices(func, args, kwargs)
        if target is not None and (name.endswith("_like") or name.startswith("new_")):
            devices = []  # a factory with a template tensor: the template's device does not matter
        if target is not None or (not devices and "device" in kwargs):  # a factory's own device (None: the CPU)
            devices.append("cuda" if to_device else torch.device(target or "cpu").type)
        if to_device:
            kwargs["device"] = torch.device("cpu")
        if func not in _TRANSFERS and len(set(devices)) > 1:
            raise DeviceMismatchError(f"{func} got tensors on {sorted(set(devices))}")
        first_on_device = bool(args) and isinstance(args[0], EmuTensor)
        if func is _ATEN._to_copy.default:
            on_device = to_device or (target is None and first_on_device)  # a dtype-only copy stays where it is
            to_host = first_on_device and not on_device
        elif func is _ATEN.copy_.default:
            on_device, to_host = first_on_device, isinstance(args[1], EmuTensor) and not first_on_device
        else:
            on_device = to_device or "cuda" in devices
            reads_back = func is _ATEN._local_scalar_dense.default or self._syncs_inside(func, args, kwargs)
            to_host = on_device and reads_back
        self.stats.device_to_host += to_host
        self.stats.ops_by_name[str(func)] = self.stats.ops_by_name.get(str(func), 0) + 1
        args_cpu, kwargs_cpu = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        if func is _ATEN.histc.default and not args_cpu[0].is_floating_point():
            # CUDA's histc takes integer input, the CPU kernel does not (transformers' MoE relies on it on GPUs).
            args_cpu = (args_cpu[0].float(), *args_cpu[1:])
            out = func(*args_cpu, **kwargs_cpu).to(args[0].dtype)
        else:
            out = func(*args_cpu, **kwargs_cpu)
        if func is _ATEN.copy_.default:
            return args[0]
        if not on_device:
            return out
        with torch.inference_mode(False):  # an inference-mode wrapper cannot take the version counter of a view
            return tree_map(lambda x: EmuTensor(x) if type(x) is torch.Tensor else x, out)

    def _syncs_inside(self, func, args: tuple, kwargs: dict) -> bool:
        """CUDA kernels that read a result back to the host before they can size their output or pick a path."""
        if func.overloadpacket.__name__ in _SYNCING:
            return True
        if func in (_ATEN.repeat_interleave.Tensor, _ATEN.repeat_interleave.self_Tensor):
            return kwargs.get("output_size") is None
        if func in _INDEXING:  # a boolean mask index is a nonzero()
            masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
            return bool(masks)
        if func is _ATEN._grouped_mm.default:  # only bf16 on sm90 / sm100 has the kernel that keeps offsets on the GPU
            bf16 = all(t.dtype == torch.bfloat16 for t in args[:2])
            return not (bf16 and self.capability[0] in (9, 10))
        return False


_METADATA_INPLACE = frozenset({"unsqueeze_", "squeeze_", "transpose_", "t_", "as_strided_", "resize_", "resize_as_",
                               "set_", "swapdims_", "swapaxes_"})
_SYNCING = frozenset({"nonzero", "masked_select", "bincount", "_unique2", "unique_dim", "unique_consecutive", "equal"})
# Non-pointwise ops that take a CPU 0-dim tensor as a scalar on CUDA (pointwise ops all do).
_TAKES_CPU_SCALAR = (_ATEN.fill_.Tensor, _ATEN.fill.Tensor, _ATEN.masked_fill.Tensor, _ATEN.masked_fill_.Tensor)


def _devices(func, args: tuple, kwargs: dict) -> list[str]:
    """The devices an op's tensor arguments force it onto, leaving out what CUDA moves by itself: CPU index
    tensors of the indexing ops, CPU 0-dim tensors of pointwise ops (and of index_put's value without accumulate)."""
    scalars_ok = torch.Tag.pointwise in func.tags or func in _TAKES_CPU_SCALAR
    accumulate = func in _INDEXING and len(args) > 3 and bool(args[3])
    devices = []
    for pos, arg in enumerate((*args, *kwargs.values())):
        for x in tree_flatten(arg)[0]:
            if isinstance(x, EmuTensor):
                devices.append("cuda")
            elif isinstance(x, torch.Tensor):
                index = func in _INDEXING and pos == 1
                value = func in _INDEXING and pos == 2 and not accumulate
                if x.device.type == "cpu" and (index or (x.dim() == 0 and (scalars_ok or value))):
                    continue
                devices.append(x.device.type)
    return devices


def _unwrap(x: object) -> object:
    return x.inner if isinstance(x, EmuTensor) else x


def _to_args(args: tuple, kwargs: dict) -> tuple[object, object]:
    """(device, dtype) of a `Tensor.to` call, each None when not given."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):  # a bool is non_blocking
            device = a
    return device, dtype


def _check_generator(func, args: tuple, kwargs: dict) -> None:
    """A generator must be on the device of the op that draws from it. Checked here: the aten op gets a fresh
    `torch._C.Generator` object, without the `emulated` mark."""
    gens = [g for g in (*args, *kwargs.values()) if isinstance(g, _GENERATOR)]
    if not gens:
        return
    gen_device = "cuda" if getattr(gens[0], "emulated", False) else gens[0].device.type
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    op_device = torch.device(kwargs["device"]).type if kwargs.get("device") is not None else (
        tensors[0].device.type if tensors else "cpu")
    if gen_device != op_device:
        raise DeviceMismatchError(f"{func.__name__} on {op_device} got a generator on {gen_device}")


class _Function(TorchFunctionMode):
    """Moves to the device through aten `_to_copy`: the Python bindings of `.to` and `torch.tensor` would ask the
    (absent) CUDA runtime first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_generator(func, args, kwargs)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and _is_cuda(kwargs.get("device")):
            host = func(*args, **{**kwargs, "device": "cpu"})
            return host if isinstance(host, EmuTensor) else _ATEN._to_copy.default(host, device=CUDA)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            device, dtype = _to_args(args[1:], kwargs) if func is torch.Tensor.to else ("cuda", None)
            if _is_cuda(device):
                src = args[0]
                if isinstance(src, EmuTensor) and dtype in (None, src.dtype):
                    return src
                return _ATEN._to_copy.default(src, dtype=dtype or src.dtype, device=CUDA)
        if func is torch.Tensor.tolist and isinstance(args[0], EmuTensor):  # refused for subclasses: copy first
            return _ATEN._to_copy.default(args[0], device=torch.device("cpu")).tolist()
        return func(*args, **kwargs)


# c10 ships a fake device guard for tests; registered for CUDA, the bindings that enter a device guard (indexing,
# `.to`, ...) stop failing with "not linked with support for cuda devices". It stays registered for the process.
_GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""
_guard_library: ctypes.CDLL | None = None


def compiler() -> str | None:
    """The C++ compiler that builds the fake guard, or None."""
    return shutil.which("c++") or shutil.which("g++")


def _register_fake_cuda_guard() -> None:
    global _guard_library
    if _guard_library is not None:
        return
    library = Path(tempfile.gettempdir()) / f"deltaserve-fake-cuda-guard-torch-{torch.__version__}.so"
    if not library.exists():  # built once per machine and torch version (0.7 s)
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("emulated_cuda() needs a C++ compiler (c++ or g++) to build its device guard")
        torch_dir = Path(torch.__file__).parent
        with tempfile.TemporaryDirectory(prefix="fake-cuda-guard-") as build:
            source, built = Path(build) / "guard.cpp", Path(build) / "guard.so"
            source.write_text(_GUARD_SOURCE)
            subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(source),
                            f"-L{torch_dir / 'lib'}", "-lc10", "-o", str(built)], check=True)
            os.replace(built, library)  # atomic: a concurrent test process never loads half a file
    _guard_library = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


@contextlib.contextmanager
def emulated_cuda(free_bytes: int = 4 << 30, name: str = "emulated CUDA",
                  capability: tuple[int, int] = (9, 0)) -> Iterator[EmulationStats]:
    """Run the body with an emulated ``cuda:0`` (see the module docstring); yields the running statistics.

    `free_bytes` is what `torch.cuda.mem_get_info` reports, `name` what `torch.cuda.get_device_name` does and
    `capability` what `torch.cuda.get_device_capability` does.
    """
    if torch.cuda.is_available():
        raise RuntimeError("emulated_cuda() is for machines without CUDA")
    _register_fake_cuda_guard()
    stats = EmulationStats()
    with contextlib.ExitStack() as stack:
        # The C++ arg parser calls torch.cuda._lazy_init() for a "cuda" device; marked done, it returns.
        stack.enter_context(mock.patch.object(torch.cuda, "_initialized", True))
        stack.enter_context(mock.patch.object(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, free_bytes)))
        stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: True))
        stack.enter_context(mock.patch.object(torch.cuda, "device_count", lambda: 1))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_name", lambda device=None: name))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability))
        stack.enter_context(mock.patch.object(torch, "Generator", EmuGenerator))
        # Module.to() would otherwise set `param.data`, which keeps the Parameter's class and loses the wrapper.
        stack.enter_context(mock.patch.object(torch.__future__, "_overwrite_module_params_on_conversion", True))
        stack.enter_context(_Function())
        stack.enter_context(_Dispatch(stats, capability))
        yield stats
