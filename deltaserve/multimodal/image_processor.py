"""Kimi K2.5 / K3 image preprocessing in numpy, equal to transformers' `Kimi_K25ImageProcessor` (5.24): the NaViT
resize rule, antialiased bicubic resize, zero padding to whole merge blocks, normalisation, and the flat patch
layout with its (t, h, w) grid."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deltaserve.config.vision import VisionConfig
from deltaserve.multimodal.image_loader import LoadedImage
from deltaserve.multimodal.resize import resize_bicubic_uint8


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageProcessingConfig:
    """The preprocessing settings (transformers' defaults for Kimi K2.5)."""

    patch_size: int = 14
    """Pixels per side of a patch (the vision tower's `patch_size`)."""
    merge_size: int = 2
    """Patches per side of one merged token (the tower's `merge_kernel_size`)."""
    max_patches: int = 16384
    """Images with more patches than this are scaled down to fit."""
    max_patches_per_side: int = 512
    """Images with more patches than this along a side are scaled down to fit (transformers' `size.max_height`)."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "max_patches", "max_patches_per_side"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> ImageProcessingConfig:
        """The settings for a checkpoint's tower: its patch size, (square) merge kernel and patch limits."""
        kh, kw = vision.merge_kernel_size
        if kh != kw:
            raise ValueError(f"merge_kernel_size={vision.merge_kernel_size} is not square: the image processor pads "
                             "both sides to the same merge size")
        return cls(patch_size=vision.patch_size, merge_size=kh, max_patches=vision.max_patches,
                   max_patches_per_side=vision.max_patches_per_side)


@dataclass(frozen=True, slots=True)
class ResizePlan:
    """Where an image of a given size goes: resized to `resized`, then zero-padded (bottom, right) to `padded`."""

    resized: tuple[int, int]
    """(height, width) after the resize (never larger than the input)."""
    padded: tuple[int, int]
    """(height, width) after padding to whole merge blocks."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ProcessedImage:
    """One image ready for the vision tower."""

    pixel_values: np.ndarray = field(repr=False)
    """``[h * w, 3, patch_size, patch_size]`` float32 patches in raster order (row of patches by row)."""
    grid_thw: tuple[int, int, int]
    """(t, h, w): frames (1 for an image) and patches per column and per row."""
    num_tokens: int
    """Placeholder tokens the image takes in the prompt: its merged tokens, t * h * w / merge_size**2 for t = 1."""
    content_hash: str
    """The source image's `image_content_hash`."""


def plan_resize(height: int, width: int, config: ImageProcessingConfig) -> ResizePlan:
    """transformers' `navit_resize`: scale down (never up) to at most `max_patches` patches and
    `max_patches_per_side` patches per side, then pad each side up to a multiple of patch_size * merge_size.
    The float expressions are kept in transformers' order so that the integer sizes agree."""
    patch, side = config.patch_size, config.max_patches_per_side
    num_patches_h = max(1.0, height // patch)
    num_patches_w = max(1.0, width // patch)
    scale_for_total = math.sqrt(config.max_patches / (num_patches_h * num_patches_w))
    scale = min(1.0, scale_for_total, (side * patch) / height, (side * patch) / width)
    new_height = min(max(1, int(height * scale)), side * patch)
    new_width = min(max(1, int(width * scale)), side * patch)
    factor = config.merge_size * patch
    pad_height = (factor - new_height % factor) % factor + new_height
    pad_width = (factor - new_width % factor) % factor + new_width
    return ResizePlan(resized=(new_height, new_width), padded=(pad_height, pad_width))


def num_image_tokens(height: int, width: int, config: ImageProcessingConfig) -> int:
    """Placeholder tokens an image of this size takes, without decoding it."""
    pad_height, pad_width = plan_resize(height, width, config).padded
    return (pad_height // config.patch_size) * (pad_width // config.patch_size) // config.merge_size**2


def preprocess_image(image: LoadedImage, config: ImageProcessingConfig) -> ProcessedImage:
    """Resize, pad, normalise and patch one image (transformers' `Kimi_K25ImageProcessor`, bit for bit)."""
    plan = plan_resize(image.height, image.width, config)
    pixels = resize_bicubic_uint8(image.pixels, *plan.resized)
    padded = np.zeros((*plan.padded, 3), dtype=np.uint8)
    padded[: pixels.shape[0], : pixels.shape[1]] = pixels
    values = _normalize(padded, config)  # [H, W, 3]
    patch = config.patch_size
    grid_h, grid_w = plan.padded[0] // patch, plan.padded[1] // patch
    # [H, W, C] -> [gh, p, gw, p, C] -> [gh, gw, C, p, p]: patch-major, then channel, then pixel rows.
    patches = values.reshape(grid_h, patch, grid_w, patch, 3).transpose(0, 2, 4, 1, 3)
    pixel_values = np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3, patch, patch))
    return ProcessedImage(
        pixel_values=pixel_values,
        grid_thw=(1, grid_h, grid_w),
        num_tokens=grid_h * grid_w // config.merge_size**2,
        content_hash=image.content_hash,
    )


def _normalize(pixels: np.ndarray, config: ImageProcessingConfig) -> np.ndarray:
    """(x - mean / rescale) / (std / rescale) in float32: transformers fuses the rescale into mean and std this way
    (float32 mean and std times the float32 1 / rescale_factor) and then normalises in float32."""
    inverse = np.float32(1.0 / config.rescale_factor)
    mean = np.asarray(config.image_mean, dtype=np.float32) * inverse
    std = np.asarray(config.image_std, dtype=np.float32) * inverse
    return (pixels.astype(np.float32) - mean) / std
