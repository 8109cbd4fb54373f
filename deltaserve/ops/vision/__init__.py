"""The Kimi vision tower's ops: the only names layers call, dispatched (today only the references)."""

from deltaserve.ops import dispatch
from deltaserve.ops.vision import ref
from deltaserve.ops.vision.ref import Grid, cu_seqlens_of, rope_2d_cos_sin, time_embedding

apply_rope_2d = dispatch.op("vision_apply_rope_2d", ref.apply_rope_2d)
interpolate_pos_emb = dispatch.op("vision_interpolate_pos_emb", ref.interpolate_pos_emb)
varlen_attention = dispatch.op("vision_varlen_attention", ref.varlen_attention)
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
