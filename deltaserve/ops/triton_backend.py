"""Where the Triton kernels run: on a CUDA device with triton installed, in bf16, fp16 or fp32; and, for their parity
tests, on a CPU in fp32 under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported; bf16
`tl.dot` is wrong there). Under the interpreter a kernel runs only when forced (`forced_only`;
`DELTASERVE_OPS_BACKEND=mla_decode=triton`): a tiny engine end to end on the kernels, slowly. Each family registers
its Triton backend after its CPU backends."""

from __future__ import annotations

import importlib.util

import torch

from deltaserve import envs

COMPILED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    """triton is importable, and there is a CUDA device or the interpreter is on."""
    return importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or envs.triton_interpret())


def forced_only() -> bool:
    """Under the interpreter: correct, but thousands of times slower than the CPU backends and the references."""
    return envs.triton_interpret()


def runs_on(t: torch.Tensor) -> bool:
    """Whether a kernel takes this tensor: a CUDA tensor of a compiled dtype (not under the interpreter, which works
    on host memory), or a CPU fp32 tensor under the interpreter."""
    if envs.triton_interpret():
        return t.device.type == "cpu" and t.dtype == torch.float32
    return t.is_cuda and t.dtype in COMPILED_DTYPES
