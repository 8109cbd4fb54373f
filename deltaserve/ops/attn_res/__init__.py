"""Block Attention Residuals (model-spec §7): the only name layers call (today the pure-PyTorch reference)."""

from deltaserve.ops.attn_res.ref import attn_res_mix

__all__ = ["attn_res_mix"]
