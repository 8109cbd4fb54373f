"""KDA ops (model-spec §3): the only names layers call, dispatched through `deltaserve.ops.dispatch` (today only the
pure-PyTorch reference; a fast backend registers here)."""

from deltaserve.ops import dispatch
from deltaserve.ops.kda import ref

kda_gate = dispatch.op("kda_gate", ref.kda_gate)
kda_prefill = dispatch.op("kda_prefill", ref.kda_prefill)
kda_decode = dispatch.op("kda_decode", ref.kda_decode)

__all__ = ["kda_decode", "kda_gate", "kda_prefill"]
