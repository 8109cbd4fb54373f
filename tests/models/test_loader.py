"""Weight loading: single file and shards, both dense-layer names, and errors that name the offending tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.models.loader import WeightLoadError, load_model
from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint
from tests.helpers import full_logits, prompt_ids


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda t: t.pop("model.layers.1.self_attn.b_proj.weight"), "missing.*model.layers.1.self_attn.b_proj.weight"),
        (lambda t: t.__setitem__("model.layers.1.self_attn.bogus.weight",
                                 t.pop("model.layers.1.self_attn.b_proj.weight")),
         "unexpected.*model.layers.1.self_attn.bogus.weight"),
        (lambda t: t.__setitem__("model.layers.3.self_attn.kv_b_proj.weight", torch.zeros(3, 64)),
         "model.layers.3.self_attn.kv_b_proj.weight.*shape \\[3, 64\\]"),
        (lambda t: t.__setitem__("model.layers.0.block_sparse_moe.gate_proj.weight",
                                 t["model.layers.0.mlp.gate_proj.weight"].clone()), "appears twice"),
    ],
    ids=["removed", "renamed", "reshaped", "duplicate-alias"],
)
def test_bad_checkpoint_names_the_tensor(tiny_dir, tmp_path, edit, needle):
    """A removed, renamed, reshaped or duplicated tensor fails with a message naming it."""
    bad = _copy_with(tiny_dir("base"), tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=needle):
        load_model(bad)


def test_dense_layer_names_are_interchangeable(tmp_path):
    """A checkpoint saved with block_sparse_moe.* for the dense layer gives the same logits as one with mlp.*."""
    a = write_tiny_checkpoint(tmp_path / "a", TinySpec(layers=4, seed=5))
    b = write_tiny_checkpoint(tmp_path / "b", TinySpec(layers=4, seed=5, dense_name="block_sparse_moe"))
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in load_file(str(b / "model.safetensors"))
    ids = prompt_ids(1024, 20, seed=1)
    assert torch.equal(full_logits(load_model(a), ids), full_logits(load_model(b), ids))


def test_sharded_equals_single_file(tmp_path):
    """Weights split over shards with an index load to the same model as one file."""
    single = write_tiny_checkpoint(tmp_path / "one", TinySpec(layers=4, seed=6))
    sharded = write_tiny_checkpoint(tmp_path / "many", TinySpec(layers=4, seed=6, shard_bytes=500_000))
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    ids = prompt_ids(1024, 20, seed=2)
    assert torch.equal(full_logits(load_model(single), ids), full_logits(load_model(sharded), ids))


def test_bfloat16_keeps_gates_in_fp32(tiny_dir):
    """In bf16 the router, bias and decay parameters stay fp32, and the logits are no further from the fp32 logits
    than transformers' own bf16 run is, within 1.5x (the perturbed tiny model is chaotic: bf16 error is large for both
    and moves with GEMM blocking)."""
    transformers = pytest.importorskip("transformers")
    path = tiny_dir("base")
    model = load_model(path, dtype=torch.bfloat16)
    layer = model.layers[1]
    assert layer.mlp.gate_weight.dtype == torch.float32 and layer.self_attn.dt_bias.dtype == torch.float32
    assert layer.self_attn.A_log.dtype == torch.float32 and layer.mlp.correction_bias.dtype == torch.float32
    assert layer.self_attn.in_proj.weight.dtype == torch.bfloat16
    ids = prompt_ids(1024, 24, seed=3)
    ref = full_logits(load_model(path), ids)
    hf = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        hf_err = (hf(torch.tensor([ids])).logits[0].float() - ref).abs().mean()
    our_err = (full_logits(model, ids) - ref).abs().mean()
    assert our_err <= 1.5 * hf_err, f"bf16 mean |error| {our_err:.3f} vs transformers bf16 {hf_err:.3f}"
