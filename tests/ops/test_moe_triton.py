"""The fused Triton MoE (`ops/moe/triton_moe.py`) against the reference `moe_experts`, in fp32 under the Triton
interpreter (marked `interpret`; skipped without triton) and on a GPU (marked `gpu`): dense and MXFP4 expert stacks
(MXFP4 decoded inside the kernel), SiLU-GLU and K3's SiTU with gate/up rows split or interleaved, fp32 combine or
not, pairs of another expert-parallel rank's expert (id -1), experts with no tokens and with several blocks of them,
widths that are not multiples of the tile sizes."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.activation import silu_and_mul, situ_and_mul
from deltaserve.ops.moe import ref
from deltaserve.ops.mxfp4 import mxfp4_linear
from deltaserve.ops.mxfp4.ref import mxfp4_quantize
from tests.helpers import relative_error

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (kernels extra)"),
              pytest.mark.usefixtures("default_dispatch")]
if importlib.util.find_spec("triton") is not None:
    from deltaserve.ops.moe import triton_moe

K3_SITU = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0, interleaved=True)


def routing(tokens: int, top_k: int, experts: int, g: torch.Generator, *, skip: bool, crowd: bool):
    """Distinct experts per token (some -1 with `skip`; expert 1 in every token's first slot with `crowd`)."""
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if crowd:
        ids[:, 0] = 1
        ids[:, 1:] = torch.where(ids[:, 1:] == 1, 0, ids[:, 1:])
    if skip:
        ids[torch.rand(tokens, top_k, generator=g) < 0.25] = -1
    weights = torch.rand(tokens, top_k, generator=g)
    return weights, ids


CASES = {  # name: (tokens, top_k, experts, d, inter, act, mxfp4, fp32_combine, skip, crowd)
    "dense-silu": (7, 2, 6, 40, 24, silu_and_mul, False, False, True, False),
    "dense-situ-interleaved-fp32combine": (9, 3, 5, 48, 40, K3_SITU, False, True, True, False),
    "dense-silu-crowded": (40, 2, 4, 32, 16, silu_and_mul, False, False, False, True),
    "mxfp4-situ-interleaved-fp32combine": (6, 2, 4, 64, 32, K3_SITU, True, True, True, False),
    "mxfp4-silu": (5, 2, 3, 32, 64, silu_and_mul, True, False, False, True),
    "mxfp4-situ-no-linear-beta": (4, 2, 3, 64, 32, functools.partial(situ_and_mul, beta=4.0, linear_beta=None,
                                                                     interleaved=True), True, True, False, False),
}


def make(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    tokens, top_k, experts, d, inter, act, mxfp4, fp32_combine, skip, crowd = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(tokens, d, generator=g)
    w13 = torch.randn(experts, 2 * inter, d, generator=g) * d ** -0.5
    w2 = torch.randn(experts, d, inter, generator=g) * inter ** -0.5
    weights, ids = routing(tokens, top_k, experts, g, skip=skip, crowd=crowd)
    linear = F.linear
    if mxfp4:
        w13, w2 = mxfp4_quantize(w13), mxfp4_quantize(w2)
        w13, w2 = (type(w)(w.packed.to(device), w.scale.to(device)) for w in (w13, w2))
        linear = mxfp4_linear
    else:
        w13, w2 = w13.to(device, dtype), w2.to(device, dtype)
    return (x.to(device, dtype), w13, w2, weights.to(device), ids.to(device)), dict(
        act=act, linear=linear, fp32_combine=fp32_combine)


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_equals_the_reference_fp32(triton_interpreter, name):
    args, kwargs = make(name)
    got = triton_moe.moe_experts_triton(*args, **kwargs)
    want = ref.moe_experts(*args, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    assert relative_error(got, want) < 1e-5
    if CASES[name][8]:  # a token whose every expert is another rank's gets exactly nothing
        ids = args[4]
        none = (ids < 0).all(dim=1)
        assert torch.equal(got[none], torch.zeros_like(got[none]))


@pytest.mark.interpret
def test_no_tokens(triton_interpreter):
    args, kwargs = make("dense-silu")
    x, w13, w2, weights, ids = args
    out = triton_moe.moe_experts_triton(x[:0], w13, w2, weights[:0], ids[:0], **kwargs)
    assert out.shape == (0, x.shape[1])


def test_dispatch_sends_what_the_kernel_knows_and_nothing_else():
    """Asked on CPU tensors (which the kernels take only under the interpreter, as here without a GPU): known
    activations and formats pass, others (a lambda activation, MXFP8 activation rounding, fp64) do not."""
    from deltaserve import envs
    from deltaserve.ops import moe

    supports = next(b.supports for b in moe.moe_experts.backends if b.name == "triton")  # type: ignore[attr-defined]
    args, kwargs = make("mxfp4-situ-interleaved-fp32combine")
    assert supports(*args, **kwargs) is envs.triton_interpret()
    assert not supports(*args, **{**kwargs, "act": lambda t: t})
    assert not supports(*args, **{**kwargs, "linear": functools.partial(mxfp4_linear, mxfp8_activations=True)})
    dense, dense_kwargs = make("dense-silu")
    assert supports(*dense, **dense_kwargs) is envs.triton_interpret()
    assert not supports(dense[0].double(), *dense[1:], **dense_kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_equals_the_reference(name):
    """fp32 (IEEE dots) at 1e-5; bf16 against the fp64 reference on the same bf16 inputs at 2e-2."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args, kwargs = make(name, device="cuda", dtype=dtype)
        got = triton_moe.moe_experts_triton(*args, **kwargs)
        x, w13, w2, weights, ids = args
        cpu = (x.double().cpu(), *((w13.cpu().double(), w2.cpu().double()) if isinstance(w13, torch.Tensor)
                                   else (type(w13)(w13.packed.cpu(), w13.scale.cpu()),
                                         type(w2)(w2.packed.cpu(), w2.scale.cpu()))),
               weights.cpu(), ids.cpu())
        want = ref.moe_experts(*cpu, **kwargs)
        assert got.dtype == dtype and relative_error(got.double().cpu(), want) < tol
