"""Antialiased bicubic resize of uint8 images in numpy, bit-exact with torch's CPU uint8 kernel
(`F.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)`), which is what torchvision, and so
transformers' Kimi K2.5 image processor, runs on a CPU.

The kernel is Pillow's (cubic a = -0.5, support scaled by the downscale factor, weights normalised per output pixel),
evaluated in integers: the float64 weights are rounded to int16 with the most precision bits that keep the largest
weight below 2**15, each pass sums ``pixel * weight`` in integers, adds half, shifts and clips to [0, 255]. Width is
resized first, then height, through a uint8 intermediate. Pillow itself keeps 22 bits per weight, so it differs from
this by one level on a fraction of a percent of pixels.
"""

from __future__ import annotations

import numpy as np

_CUBIC_A = -0.5
_INTERP_SIZE = 4  # taps of the cubic kernel before antialias scaling
_MAX_PRECISION = 22


def _cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = _CUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output position: the first input index [out], int16-rounded weights [out, taps] (zero past the range) and
    the precision bits; torch's `_compute_index_ranges_int16_weights` with antialias, in the same float64 order."""
    scale = in_size / out_size
    support = _INTERP_SIZE * 0.5 * scale if scale >= 1.0 else _INTERP_SIZE * 0.5
    taps = int(np.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    starts = np.zeros(out_size, dtype=np.int64)
    weights = np.zeros((out_size, taps), dtype=np.float64)
    for i in range(out_size):  # scalar float64 math, as the C++ loop does (a vectorised sum could round differently)
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), taps)
        w = _cubic((np.arange(xsize) + xmin - center + 0.5) * invscale)
        total = 0.0
        for v in w:  # sequential sum, as the C++ loop
            total += float(v)
        if total != 0.0:
            w = w / total
        starts[i] = xmin
        weights[i, :xsize] = w
    w_max = float(weights.max()) if weights.size else 0.0
    precision = 0
    while precision < _MAX_PRECISION and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * float(1 << precision)
    rounded = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return starts, rounded, precision


def _resize_axis(image: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """Resize a uint8 array along `axis` (0: rows, 1: columns) of an [H, W, C] image."""
    in_size = image.shape[axis]
    starts, weights, precision = _axis_weights(in_size, out_size)
    taps = weights.shape[1]
    index = np.minimum(starts[:, None] + np.arange(taps)[None, :], in_size - 1)  # [out, taps]; zero weight past range
    src = np.moveaxis(image, axis, 0).astype(np.int32)  # [in, other, C]
    # int32 as torch's kernel accumulates: |sum| <= 255 * sum|w| stays far below 2**31 (sum|w| ~ 2**precision).
    acc = np.full((out_size, *src.shape[1:]), 1 << (precision - 1) if precision > 0 else 0, dtype=np.int32)
    w32 = weights.astype(np.int32)
    for k in range(taps):
        acc += src[index[:, k]] * w32[:, k, None, None]
    out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_bicubic_uint8(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an [H, W, C] uint8 image to [height, width, C] as torch's CPU uint8 antialiased bicubic does.

    Args:
        image: ``[H, W, C]`` uint8.
        height, width: the output size, each >= 1.

    Returns:
        ``[height, width, C]`` uint8; the input itself when the size is unchanged.
    """
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"expected an [H, W, C] uint8 image, got {image.dtype} {image.shape}")
    if height < 1 or width < 1:
        raise ValueError(f"output size must be positive, got {height}x{width}")
    out = image
    if width != image.shape[1]:
        out = _resize_axis(out, width, axis=1)
    if height != image.shape[0]:
        out = _resize_axis(out, height, axis=0)
    return out
