"""Dense linear ``y = x W^T``: the entry point layers call for every dense projection, dispatched. A weight packed at
load time (`pack`, oneDNN's blocked layout, CPU) takes the `onednn` backend; a plain fp32 / bf16 CPU weight takes the
`native` backend: its C kernel for up to 16 rows of large fp32 weights and of bf16 ones (decode, verify chunks), and
bf16 GEMMs of more rows as fp32 on CPUs without bf16 arithmetic; everything else runs the reference."""

from __future__ import annotations

import torch.nn.functional as F

from deltaserve.ops import dispatch
from deltaserve.ops.linear import native, onednn, ref
from deltaserve.ops.linear.onednn import can_pack, pack

linear = dispatch.op("linear", ref.linear)
dispatch.register("linear", dispatch.Backend("onednn", onednn.linear, available=onednn.available,
                                             supports=onednn.supports))
dispatch.register("linear", dispatch.Backend("native", native.linear, available=native.available,
                                             supports=native.supports))

PLAIN_LINEARS = (F.linear, linear)
"""The linears that mean ``x W^T`` on plain weight tensors: MoE backends that run their own GEMMs (or C kernels) over
plain expert stacks accept either as their `linear` argument."""

__all__ = ["PLAIN_LINEARS", "can_pack", "linear", "pack"]
