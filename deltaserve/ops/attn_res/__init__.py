"""Block Attention Residuals (model-spec §7): the only name layers call, dispatched (today only the reference)."""

from deltaserve.ops import dispatch
from deltaserve.ops.attn_res import ref

attn_res_mix = dispatch.op("attn_res_mix", ref.attn_res_mix)

__all__ = ["attn_res_mix"]
