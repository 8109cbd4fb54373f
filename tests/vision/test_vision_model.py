"""The vision tower + projector (`KimiVisionModel`) against transformers' `Kimi_K25VisionModel` +
`Kimi_K25MultimodalProjection` loaded by transformers from the same Moonshot-named weights (fp32, relative error
<= 1e-5), from patches and from images through both preprocessors; and the tiny K3 checkpoint with a vision tower."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from deltaserve.config import ModelConfig
from deltaserve.models.kimi_vision import KimiVisionModel, load_vision_model, num_vision_tokens
from deltaserve.models.loader import WeightLoadError, load_model
from deltaserve.models.tiny_k3 import write_tiny_k3_checkpoint
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.models.tiny_vision import TinyVisionSpec, random_vision_weights, tiny_vision_config
from deltaserve.multimodal import ImageProcessingConfig, load_image, preprocess_image
from tests.vision.images import encode, noise, shapes
from tests.vision.k25_model_oracle import load_oracle, oracle_features
from tests.vision.k25_oracle import oracle_preprocess

TOLERANCE = 1e-5
# transformers resamples the position grid as a square (`num_grid_per_side = pos_emb_height`), as the real one is
# (64 x 64), so the oracle specs keep it square.
SPECS = {
    "tiny": TinyVisionSpec(),
    "odd": TinyVisionSpec(hidden=48, layers=3, heads=3, intermediate=72, pos_emb_height=7, pos_emb_width=7, seed=7),
}
GRIDS = {
    "square": [(1, 8, 8)],
    "wide": [(1, 2, 30)],
    "tall": [(1, 24, 2)],
    "small": [(1, 2, 2)],
    "batch": [(1, 4, 6), (1, 10, 2), (1, 2, 2), (1, 16, 12)],
}


def rel_error(out: torch.Tensor, want: torch.Tensor) -> float:
    assert out.shape == want.shape and not torch.isnan(out).any()
    return float((out - want).norm() / want.norm())


def _ours(config, weights) -> KimiVisionModel:
    model = KimiVisionModel(config)
    targets = model.checkpoint_tensors()
    assert set(targets) == set(weights)
    with torch.no_grad():
        for name, tensor in weights.items():
            targets[name].copy_(tensor)
    return model.eval()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """spec name -> (ours, transformers' oracle), both from the same random weights."""
    made = {}
    for name, spec in SPECS.items():
        config = tiny_vision_config(spec, text_hidden=40)
        weights = random_vision_weights(config, spec.seed)
        made[name] = (_ours(config, weights), load_oracle(config, weights, tmp_path_factory.mktemp(name)))
    return made


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
@pytest.mark.parametrize("spec", list(SPECS))
def test_vision_model_matches_transformers(pairs, spec, grids):
    """Projected features of random patches equal transformers' `get_image_features` (tower + projector)."""
    ours, oracle = pairs[spec]
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        out = ours(pixels, grids)
    want = oracle_features(oracle, pixels, grids)
    assert out.shape == (sum(num_vision_tokens(grids, ours.config)), 40)
    assert rel_error(out, want) <= TOLERANCE


@pytest.mark.parametrize("size", [(100, 80), (30, 300), (400, 20), (9, 9), (333, 517)])
def test_images_end_to_end_match_transformers(pairs, size):
    """An image through our preprocessing and model equals it through transformers' processor and model (the
    resize limits are lowered so that the larger images are resized)."""
    ours, oracle = pairs["tiny"]
    data = encode(shapes(*size), "PNG")
    processed = preprocess_image(load_image(data), ImageProcessingConfig(max_patches=200))
    pixel_values, grid = oracle_preprocess(Image.open(io.BytesIO(data)), max_patches=200)
    with torch.no_grad():
        out = ours(torch.from_numpy(processed.pixel_values), [processed.grid_thw])
    want = oracle_features(oracle, torch.from_numpy(pixel_values), [grid])
    assert out.shape[0] == processed.num_tokens
    assert rel_error(out, want) <= TOLERANCE


def test_rotary_layout_matters(pairs):
    """Negative control: q and k weights in transformers' permuted layout (not the checkpoint's) miss by far more
    than the tolerance, so the parity above does test the layout."""
    ours, oracle = pairs["tiny"]
    config = ours.config
    weights = random_vision_weights(config, SPECS["tiny"].seed)
    d, heads = config.hidden_size, config.num_attention_heads
    for name in [n for n in weights if n.endswith("wqkv.weight")]:
        w = weights[name].clone()
        qk = w[: 2 * d].unflatten(0, (2 * heads, -1, 2)).transpose(1, 2).flatten(0, 2)
        w[: 2 * d] = qk
        weights[name] = w
    wrong = _ours(config, weights)
    grids = [(1, 6, 8)]
    pixels = torch.randn(48, 3, 14, 14, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_error(wrong(pixels, grids), oracle_features(oracle, pixels, grids)) > 1e-3


def test_patch_count_must_match_grid(pairs):
    ours, _ = pairs["tiny"]
    with pytest.raises(ValueError, match="10 patches, the grids"):
        ours(torch.zeros(10, 3, 14, 14), [(1, 2, 2)])


@pytest.fixture(scope="module")
def k3_vision_dir(tmp_path_factory):
    spec = TinySpec(arch="kimi_k3", q_lora_rank=48, shared_experts=2, routed_scaling_factor=1.0, seed=4)
    return write_tiny_k3_checkpoint(tmp_path_factory.mktemp("k3-vision"), spec, vision=True)


def test_tiny_k3_vision_checkpoint_loads_and_matches_transformers(k3_vision_dir, tmp_path):
    """The tiny K3 checkpoint with a vision tower: its config parses to a VisionConfig, the vision part loads through
    the model loader and equals transformers' oracle loaded from the same tensors; the language model still loads
    (skipping them)."""
    config = ModelConfig.from_pretrained(k3_vision_dir)
    assert config.vision is not None and config.vision.text_hidden_size == config.hidden_size
    raw = json.loads((k3_vision_dir / "config.json").read_text())
    assert config.vision.media_placeholder_token_id == raw["media_placeholder_token_id"]
    model = load_vision_model(k3_vision_dir)
    with safe_open(k3_vision_dir / "model.safetensors", framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys() if k.startswith(("vision_tower.", "mm_projector."))}
    assert set(weights) == set(model.checkpoint_tensors())
    oracle = load_oracle(config.vision, weights, tmp_path / "oracle")
    image = preprocess_image(load_image(encode(noise(60, 90, seed=9), "PNG")), ImageProcessingConfig())
    pixels = torch.from_numpy(image.pixel_values)
    with torch.no_grad():
        out = model(pixels, [image.grid_thw])
    assert out.shape == (image.num_tokens, config.hidden_size)
    assert rel_error(out, oracle_features(oracle, pixels, [image.grid_thw])) <= TOLERANCE
    text = load_model(k3_vision_dir)
    assert type(text).__name__ == "KimiK3ForConditionalGeneration"


def test_text_only_k3_checkpoint_has_no_vision(tiny_dir):
    """The default tiny K3 checkpoint (a `vision_config` stub, no tensors) has no vision part."""
    path = tiny_dir("k3")
    assert ModelConfig.from_pretrained(path).vision is None
    with pytest.raises(ValueError, match="has no vision tower"):
        load_vision_model(path)


def test_missing_vision_tensor_is_named(k3_vision_dir, tmp_path):
    """A checkpoint missing a vision tensor fails to load, naming it."""
    from safetensors.torch import save_file

    with safe_open(k3_vision_dir / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "vision_tower.encoder.blocks.1.wo.bias"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((k3_vision_dir / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=r"vision_tower\.encoder\.blocks\.1\.wo\.bias"):
        load_vision_model(tmp_path)


def test_vision_weights_are_distinct_per_seed():
    config = tiny_vision_config(TinyVisionSpec(), text_hidden=40)
    a, b = random_vision_weights(config, 1), random_vision_weights(config, 2)
    assert not np.allclose(a["mm_projector.proj.0.weight"].numpy(), b["mm_projector.proj.0.weight"].numpy())


def test_bf16_model_runs_close_to_fp32(pairs):
    """A bf16 tower (bf16 weights and activations, rotary and softmax in fp32) stays within bf16 rounding of fp32."""
    ours, _ = pairs["tiny"]
    config = ours.config
    low = KimiVisionModel(config, torch.bfloat16)
    targets = low.checkpoint_tensors()
    with torch.no_grad():
        for name, tensor in ours.checkpoint_tensors().items():
            targets[name].copy_(tensor)
        grids = [(1, 4, 6), (1, 12, 8)]
        pixels = torch.randn(120, 3, 14, 14, generator=torch.Generator().manual_seed(6))
        out, want = low(pixels, grids), ours(pixels, grids)
    assert out.dtype == torch.bfloat16
    assert rel_error(out.float(), want) < 3e-2
