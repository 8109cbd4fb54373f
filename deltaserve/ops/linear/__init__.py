"""Dense linear ``y = x W^T``: the entry point layers call for every dense projection, dispatched. A weight packed at
load time (`pack`, oneDNN's blocked layout, CPU) takes the `onednn` backend; a plain tensor runs the reference."""

from __future__ import annotations

from deltaserve.ops import dispatch
from deltaserve.ops.linear import onednn, ref
from deltaserve.ops.linear.onednn import can_pack, pack

linear = dispatch.op("linear", ref.linear)
dispatch.register("linear", dispatch.Backend("onednn", onednn.linear, available=onednn.available,
                                             supports=onednn.supports))

__all__ = ["can_pack", "linear", "pack"]
