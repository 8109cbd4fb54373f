"""Static descriptions of what each model layer keeps per token (MLA latent) or per sequence (KDA state).

Pure dataclasses, no torch: the planner and the cache manager size pools from these; the runner allocates tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSpec:
    """An MLA layer: one cache row of `row_width` values per token, stored in paged blocks."""

    layer_id: int
    row_width: int
    """kv_lora_rank + qk_rope_head_dim (the latent and the shared key part)."""
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return self.row_width * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateCacheSpec:
    """A KDA layer: a fixed-size recurrent state and short-conv window per sequence, stored in slots."""

    layer_id: int
    recurrent_shape: tuple[int, ...]
    """[H, Dk, Dv] per slot, layout key rows x value columns."""
    recurrent_dtype: str
    conv_shape: tuple[int, ...]
    """[3 * H * Dh, K - 1] per slot: the last K-1 pre-conv q, k, v inputs, channels first."""
    conv_dtype: str

    @property
    def bytes_per_slot(self) -> int:
        rec = DTYPE_BYTES[self.recurrent_dtype]
        conv = DTYPE_BYTES[self.conv_dtype]
        return _numel(self.recurrent_shape) * rec + _numel(self.conv_shape) * conv


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
