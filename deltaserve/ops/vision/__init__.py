"""The Kimi vision tower's ops: the only names layers call, dispatched. `varlen_attention` has an SDPA backend
(`sdpa.py`: no score matrix, for fp32 / bf16 / fp16); the others run their references."""

from deltaserve.ops import dispatch
from deltaserve.ops.vision import ref, sdpa
from deltaserve.ops.vision.ref import Grid, cu_seqlens_of, rope_2d_cos_sin, time_embedding

apply_rope_2d = dispatch.op("vision_apply_rope_2d", ref.apply_rope_2d)
interpolate_pos_emb = dispatch.op("vision_interpolate_pos_emb", ref.interpolate_pos_emb)
varlen_attention = dispatch.op("vision_varlen_attention", ref.varlen_attention)
dispatch.register("vision_varlen_attention",
                  dispatch.Backend("sdpa", sdpa.varlen_attention_sdpa, supports=sdpa.supports))
merge_patches = dispatch.op("vision_merge_patches", ref.merge_patches)

__all__ = [
    "Grid",
    "apply_rope_2d",
    "cu_seqlens_of",
    "interpolate_pos_emb",
    "merge_patches",
    "rope_2d_cos_sin",
    "time_embedding",
    "varlen_attention",
]
