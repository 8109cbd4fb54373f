"""Preprocessing equals transformers' `Kimi_K25ImageProcessor` (through `k25_oracle`): the same resize sizes, the
same pixel values bit for bit, the same grid, and the placeholder-token count."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deltaserve.multimodal import ImageProcessingConfig, load_image, num_image_tokens, plan_resize, preprocess_image
from deltaserve.multimodal.resize import resize_bicubic_uint8
from tests.vision.images import encode, noise, shapes
from tests.vision.k25_oracle import navit_resize, oracle_preprocess

# (name, height, width, processor settings): small limits force the resize path on small images.
CASES = [
    ("no-resize", 100, 80, {}),
    ("exact-blocks", 56, 84, {}),
    ("tiny-1x1", 1, 1, {}),
    ("tiny-13x5", 13, 5, {}),
    ("resize-total", 480, 640, {"max_patches": 64}),
    ("resize-odd", 333, 517, {"max_patches": 150}),
    ("resize-per-side", 90, 700, {"max_size_per_side": 16}),
    ("extreme-tall", 2000, 3, {"max_patches": 256, "max_size_per_side": 32}),
    ("extreme-wide", 7, 3000, {"max_patches": 256}),
    ("wide-thin-no-resize", 2, 900, {}),
]


def _config(settings: dict) -> ImageProcessingConfig:
    return ImageProcessingConfig(max_patches=settings.get("max_patches", 16384),
                                 max_patches_per_side=settings.get("max_size_per_side", 512))


@pytest.mark.parametrize("name,height,width,settings", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("source", ["noise", "shapes-jpeg", "rgba"])
def test_preprocess_image_matches_transformers(name, height, width, settings, source):
    """Pixel values (bit-exact), grid and token count equal the transformers processor's on the same image."""
    from PIL import Image

    if source == "noise":
        data = encode(noise(height, width, seed=height * 7 + width), "PNG")
    elif source == "shapes-jpeg":
        data = encode(shapes(height, width), "JPEG", quality=90)
    else:
        data = encode(noise(height, width, seed=1, mode="RGBA"), "PNG")
    ours = preprocess_image(load_image(data), _config(settings))
    expected, grid = oracle_preprocess(Image.open(io.BytesIO(data)), **settings)
    assert ours.grid_thw == grid
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == expected.shape
    np.testing.assert_array_equal(ours.pixel_values, expected)
    assert ours.num_tokens == grid[1] * grid[2] // 4
    assert ours.num_tokens == num_image_tokens(height, width, _config(settings))


def test_preprocess_default_limits_resize():
    """With the default limits (16384 patches, 512 per side), a 1900 x 1800 image is scaled down exactly as
    transformers does."""
    from PIL import Image

    data = encode(shapes(1900, 1800), "PNG")
    ours = preprocess_image(load_image(data), ImageProcessingConfig())
    expected, grid = oracle_preprocess(Image.open(io.BytesIO(data)))
    resized = plan_resize(1900, 1800, ImageProcessingConfig()).resized
    assert resized[0] < 1900 and resized[1] < 1800
    assert ours.grid_thw == grid
    np.testing.assert_array_equal(ours.pixel_values, expected)


def test_plan_resize_matches_navit_resize():
    """The resize and padding sizes equal transformers' `navit_resize` over a sweep of sizes and limits."""
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (13, 14), (14, 14), (27, 29), (7168, 7168), (7169, 3), (3, 10000), (100000, 2)]
    sizes += [tuple(int(v) for v in rng.integers(1, 9000, 2)) for _ in range(300)]
    for max_patches, per_side in ((16384, 512), (64, 8), (1000, 40), (1, 1)):
        config = ImageProcessingConfig(max_patches=max_patches, max_patches_per_side=per_side)
        for height, width in sizes:
            want = navit_resize(height=height, width=width, patch_size=14, merge_kernel_size=2,
                                max_patches=max_patches, max_size_per_side=per_side)
            plan = plan_resize(height, width, config)
            assert (plan.resized, plan.padded) == want, (height, width, max_patches, per_side)


@pytest.mark.parametrize("shape", [(50, 37, 20, 37), (301, 517, 123, 211), (64, 64, 64, 1), (999, 37, 300, 11),
                                   (5, 5, 1, 2), (1, 90, 1, 40), (1000, 1000, 999, 3)])
def test_resize_bicubic_uint8_matches_torch(shape):
    """The numpy resize equals torch's CPU uint8 antialiased bicubic (torchvision's path) on every pixel. (A 1 x 1
    output trips an internal assert of torch's AVX kernel, so none is compared here.)"""
    h, w, nh, nw = shape
    image = np.array(noise(h, w, seed=h + w))
    tensor = torch.from_numpy(image).permute(2, 0, 1)[None].contiguous()
    want = F.interpolate(tensor, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
    np.testing.assert_array_equal(resize_bicubic_uint8(image, nh, nw), want[0].permute(1, 2, 0).numpy())


def test_config_for_vision():
    """The processor takes the tower's patch size, merge kernel and patch limits (`vision_config.max_patches`)."""
    from dataclasses import replace

    from deltaserve.models.tiny_vision import TinyVisionSpec, tiny_vision_config

    vision = tiny_vision_config(TinyVisionSpec(), text_hidden=32)
    config = ImageProcessingConfig.for_vision(vision)
    assert (config.patch_size, config.merge_size, config.max_patches, config.max_patches_per_side) == (14, 2, 16384,
                                                                                                       512)
    config = ImageProcessingConfig.for_vision(replace(vision, max_patches=100, max_patches_per_side=12))
    assert (config.max_patches, config.max_patches_per_side) == (100, 12)
    with pytest.raises(ValueError, match="not square"):
        ImageProcessingConfig.for_vision(replace(vision, merge_kernel_size=(2, 1)))


def test_multimodal_imports_without_torch():
    """The API process preprocesses images without torch (numpy and Pillow only)."""
    import subprocess
    import sys

    code = "import sys, deltaserve.multimodal; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
