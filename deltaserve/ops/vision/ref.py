"""Reference tensor functions of the Kimi vision tower (MoonViT, as in Kimi K2.5 / K3): the 2D rotary embedding,
the resampled learned position grid, attention within each image of a packed batch, and patch merging.

Pure PyTorch; the specification and the test oracle for any fused kernel. Images are packed along the first axis
in the order of `grid_thw`, each as t frames of h x w patches in raster order; a (t, h, w) grid is a tuple of ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Grid = tuple[int, int, int]


def rope_2d_cos_sin(grid_thw: Sequence[Grid], head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Cosines and sines of MoonViT's 2D rotary embedding, one angle per (even, odd) pair of a head's channels.

    Pair ``2f`` turns by ``col * theta**(-4f / head_dim)``, pair ``2f + 1`` by ``row * theta**(-4f / head_dim)``
    (f in [0, head_dim / 4)), where (row, col) is the patch's place in its frame; every frame repeats them.

    Args:
        grid_thw: (t, h, w) per image.
        head_dim: channels per head, a multiple of 4.
        theta: the frequency base (`rope_theta`).

    Returns:
        ``(cos, sin)``, each ``[num_patches, head_dim // 2]`` fp32.
    """
    if head_dim % 4:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 4")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)))
    parts = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).repeat_interleave(w).repeat(t).float()
        cols = torch.arange(w).repeat(h).repeat(t).float()
        # [n, F, 2] -> [n, 2F]: (col, row) angles interleaved per frequency.
        parts.append(torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1).flatten(1))
    angles = torch.cat(parts)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (even, odd) channel pair of every head by its angle, in fp32 (the checkpoint's interleaved layout,
    a complex multiply per pair).

    Args:
        x: ``[n, heads, head_dim]``.
        cos, sin: ``[n, head_dim // 2]`` from `rope_2d_cos_sin`.

    Returns:
        ``[n, heads, head_dim]`` in the dtype of `x`.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # [n, H, Dh/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)


def time_embedding(num_frames: int, dim: int) -> Tensor:
    """The fixed sinusoidal embedding of frames 0..num_frames-1 (sines, then cosines): ``[num_frames, dim]`` fp32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(num_frames, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.sin(), freqs.cos()], dim=1)


def interpolate_pos_emb(table: Tensor, grid_thw: Sequence[Grid], time_table: Tensor | None = None) -> Tensor:
    """Position embeddings of every patch: the learned grid resampled to each image's (h, w) by bicubic
    interpolation (Keys a = -0.75, half-pixel centres, edges clamped: `F.interpolate(mode="bicubic",
    align_corners=False)`), repeated per frame; a clip of t > 1 frames adds ``time_table[f]`` to frame f.

    Args:
        table: ``[H0, W0, D]`` the learned grid (`pos_emb.weight`).
        grid_thw: (t, h, w) per image.
        time_table: ``[T0, D]`` (`time_embedding`), needed only for t > 1.

    Returns:
        ``[num_patches, D]`` in the dtype of `table`.
    """
    grid = table.permute(2, 0, 1)[None]  # [1, D, H0, W0]
    parts = []
    for t, h, w in grid_thw:
        if (h, w) == tuple(table.shape[:2]):
            spatial = table.flatten(0, 1)
        else:
            spatial = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)[0].flatten(1).T
        if t == 1:
            parts.append(spatial)
            continue
        if time_table is None or t > time_table.shape[0]:
            raise ValueError(f"a clip of {t} frames needs a time table of at least {t} rows")
        parts.append((spatial[None] + time_table[:t, None, :].to(spatial.dtype)).flatten(0, 1))
    return torch.cat(parts)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Sequence[int], scale: float) -> Tensor:
    """Bidirectional attention within each segment [cu_seqlens[i], cu_seqlens[i+1]) of a packed batch (one image or
    clip each), softmax in fp32.

    Args:
        q, k, v: ``[n, heads, head_dim]``.
        cu_seqlens: segment boundaries, from 0 to n.
        scale: the score scale (head_dim ** -0.5).

    Returns:
        ``[n, heads, head_dim]`` in the dtype of `q`.
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1).float() for x in (q, k, v))  # [H, L, Dh]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


def merge_patches(x: Tensor, grid_thw: Sequence[Grid], kernel: tuple[int, int]) -> Tensor:
    """Group each image's patches into merged tokens of kernel[0] x kernel[1] neighbours (averaging a clip's frames).

    Merged tokens are in raster order of the merged grid; within one, the patches are in raster order of the kernel.

    Args:
        x: ``[num_patches, D]``.
        grid_thw: (t, h, w) per image; kernel[0] divides h and kernel[1] divides w.
        kernel: (rows, columns) per merged token.

    Returns:
        ``[num_merged, kernel[0] * kernel[1], D]``, num_merged = sum of h * w / (kernel[0] * kernel[1]).
    """
    kh, kw = kernel
    parts, start = [], 0
    for t, h, w in grid_thw:
        if h % kh or w % kw:
            raise ValueError(f"grid {h}x{w} is not a whole number of {kh}x{kw} merge blocks")
        frames = x[start:start + t * h * w].unflatten(0, (t, h // kh, kh, w // kw, kw))
        merged = frames.float().mean(0) if t > 1 else frames[0]
        parts.append(merged.permute(0, 2, 1, 3, 4).reshape(h // kh * (w // kw), kh * kw, -1).to(x.dtype))
        start += t * h * w
    return torch.cat(parts)


def cu_seqlens_of(grid_thw: Sequence[Grid]) -> list[int]:
    """Segment boundaries of a packed batch: one segment per image (all frames of a clip together)."""
    bounds = [0]
    for t, h, w in grid_thw:
        bounds.append(bounds[-1] + t * h * w)
    return bounds
