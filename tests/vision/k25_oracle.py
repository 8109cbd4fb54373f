"""The transformers oracle for the image preprocessing, usable without torchvision (not installable beside this
torch build): transformers' own `navit_resize` and `patchify`, read from the installed
`image_processing_kimi_k25.py` (its module imports torchvision, so it cannot be imported), its own `convert_to_rgb`,
and torchvision's CPU steps written out in torch: `tvF.resize` of a uint8 image with bicubic antialiasing is
`F.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)` (the image itself when the size is
unchanged), `tvF.pad` fills zeros, and `TorchvisionBackend.rescale_and_normalize` fuses the rescale into mean and
std."""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers.image_transforms import convert_to_rgb

_SOURCE = os.path.join(os.path.dirname(transformers.__file__), "models", "kimi_k25", "image_processing_kimi_k25.py")


def _extract(names: set[str]) -> dict[str, Callable[..., Any]]:
    tree = ast.parse(open(_SOURCE).read())
    found: dict[str, Callable[..., Any]] = {}
    nodes: list[ast.AST] = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            nodes += node.body
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            namespace: dict[str, Any] = {"math": math, "torch": torch}
            exec(compile(ast.Module(body=[node], type_ignores=[]), _SOURCE, "exec"), namespace)  # noqa: S102
            found[node.name] = namespace[node.name]
    assert set(found) == names, f"transformers' source no longer defines {names - set(found)}"
    return found


_FUNCS = _extract({"navit_resize", "patchify"})
navit_resize = _FUNCS["navit_resize"]


def oracle_preprocess(image: Image.Image, patch_size: int = 14, merge_size: int = 2, max_patches: int = 16384,
                      max_size_per_side: int = 512) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values [n, 3, p, p] float32, grid (t, h, w)) as `Kimi_K25ImageProcessor` computes them on a CPU."""
    rgb = torch.from_numpy(convert_to_rgb(image, return_numpy=True)).permute(2, 0, 1).contiguous()[None]
    height, width = rgb.shape[-2:]
    (rh, rw), (ph, pw) = navit_resize(height=height, width=width, patch_size=patch_size, merge_kernel_size=merge_size,
                                      max_patches=max_patches, max_size_per_side=max_size_per_side)
    if (rh, rw) != (height, width):
        rgb = F.interpolate(rgb, size=[rh, rw], mode="bicubic", align_corners=False, antialias=True)
    rgb = F.pad(rgb, (0, pw - rw, 0, ph - rh), value=0)
    mean = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    values = (rgb.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    patches, grid_h, grid_w = _FUNCS["patchify"](None, values, patch_size=patch_size)
    return patches[0].numpy(), (1, grid_h, grid_w)
