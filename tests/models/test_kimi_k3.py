"""Kimi K3 on tiny random checkpoints. K3 has no oracle we did not write (model-spec §13.4): these are
self-consistency checks (prefill + decode == full, chunked == one-shot, batched == alone), Block AttnRes against its
definition, MXFP4 layouts and load errors, and greedy generation through the engine."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deltaserve.config import ConfigError
from deltaserve.entrypoints.llm import LLM
from deltaserve.models.kimi_k3 import KimiK3ForConditionalGeneration
from deltaserve.models.loader import WeightLoadError, load_model
from deltaserve.models.quantize import quantize_checkpoint
from deltaserve.models.tiny import write_tiny_checkpoint
from deltaserve.ops.norm import rms_norm
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import ScheduledChunk
from tests.conftest import TINY_VARIANTS
from tests.helpers import full_logits, prompt_ids, relative_error
from tests.models.k3_reference import block_attn_res, full_attn_res

# As tests/runner, but fp64 runs are looser (1e-5 vs 2e-6): besides the KDA state, rounded to the fp32 pool between
# steps, K3's conv weights and windows are fp32 by design (model-spec §3.1), so the conv runs in fp32 (seen: 2.7e-6).
TOL = {torch.float32: 1e-4, torch.float64: 1e-5}
PREFIX = "language_model.model.layers"


@pytest.fixture(scope="module", params=[("k3", torch.float32), ("k3", torch.float64), ("k3-odd", torch.float64)],
                ids=["k3-fp32", "k3-fp64", "odd-fp64"])
def model(tiny_dir, request):
    variant, dtype = request.param
    return load_model(tiny_dir(variant), dtype=dtype)


def run_in_pieces(model, ids: list[int], pieces: list[int]) -> torch.Tensor:
    """Feed `ids` in consecutive chunks of the given sizes; the last-token logits of every chunk."""
    runner = ModelRunner(model, num_blocks=8, block_size=16, num_slots=3)
    blocks, done, out = [6, 2, 7, 0, 5], 0, []
    for n in pieces:
        chunk = ScheduledChunk(request_id="r", new_token_ids=ids[done : done + n], num_computed_tokens=done,
                               state_slot=1, block_ids=blocks, reset_state=done == 0)
        out.append(runner.execute_model([chunk])[0])
        done += n
    return torch.stack(out)


def test_k3_model_layout(tiny_dir):
    """Nested checkpoint -> the K3 class: `language_model.` names, MXFP4 experts as uint8, A_log [128], fp32 conv
    weights and conv windows, gated MLA and full-rank KDA gate."""
    m = load_model(tiny_dir("k3"), dtype=torch.bfloat16)
    assert isinstance(m, KimiK3ForConditionalGeneration)
    names = m.checkpoint_tensors()
    assert names[f"{PREFIX}.1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    assert tuple(names[f"{PREFIX}.1.block_sparse_moe.experts.0.w2.weight_scale"].shape) == (128, 4)
    assert tuple(names[f"{PREFIX}.0.self_attn.A_log"].shape) == (128,)
    assert names[f"{PREFIX}.0.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert f"{PREFIX}.3.self_attn.g_proj.weight" in names and f"{PREFIX}.0.self_attn.g_proj.weight" in names
    assert f"{PREFIX}.0.mlp_res_proj.weight" in names and "language_model.model.output_attn_res_norm.weight" in names
    specs = m.cache_specs()
    assert specs[0].conv_dtype == "float32" and specs[0].recurrent_dtype == "float32" and specs[3].dtype == "bfloat16"
    ids = prompt_ids(1024, 24, seed=3)
    ref = full_logits(load_model(tiny_dir("k3")), ids)
    bf16 = full_logits(m, ids)
    assert torch.isfinite(bf16).all() and (bf16.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5


def test_prefill_then_decode_equals_full_forward(model):
    """Prefill 30 tokens then 20 single-token decode steps equals one forward over all 50 (AttnRes keeps no state
    across steps; KDA with the K3 gate runs chunked in the prefill and recurrent in the decodes)."""
    ids = prompt_ids(model.config.vocab_size, 50, seed=2)
    ref = full_logits(model, ids)
    assert relative_error(run_in_pieces(model, ids, [30] + [1] * 20), ref[29:]) < TOL[model.dtype]


def test_token_by_token_equals_one_chunked_prefill(model):
    """Every token as a decode step (recurrent KDA) gives the logits of one chunked prefill of 70 tokens (chunks of
    64: the second chunk is partial)."""
    ids = prompt_ids(model.config.vocab_size, 70, seed=5)
    ref = full_logits(model, ids)
    assert relative_error(run_in_pieces(model, ids, [1] * 70), ref) < TOL[model.dtype]


def test_chunked_prefill_equals_one_shot(model):
    """Prefill in chunks of 17, 16, 1, 30 tokens gives the one-shot logits at each chunk end."""
    ids = prompt_ids(model.config.vocab_size, 64, seed=1)
    ref = full_logits(model, ids)
    pieces = [17, 16, 1, 30]
    ends = torch.tensor(pieces).cumsum(0) - 1
    assert relative_error(run_in_pieces(model, ids, pieces), ref[ends]) < TOL[model.dtype]


def test_varlen_batch_equals_each_alone(model):
    """One step holding a decode and two prefill chunks of different lengths gives each sequence's logits alone."""
    vocab = model.config.vocab_size
    seqs = [prompt_ids(vocab, n, seed=20 + n) for n in (9, 21, 33)]
    alone = [full_logits(model, s) for s in seqs]
    runner = ModelRunner(model, num_blocks=24, block_size=4, num_slots=4)
    tables = [[0, 4, 8], [1, 5, 9, 12, 13, 14], [3, 7, 10, 11, 15, 16, 17, 18, 19]]
    runner.execute_model([ScheduledChunk(request_id="w", new_token_ids=seqs[0][:-1], num_computed_tokens=0,
                                         state_slot=2, block_ids=tables[0], reset_state=True)])
    chunks = [
        ScheduledChunk(request_id="a", new_token_ids=seqs[2], num_computed_tokens=0, state_slot=1,
                       block_ids=tables[2], reset_state=True),
        ScheduledChunk(request_id="b", new_token_ids=seqs[0][-1:], num_computed_tokens=8, state_slot=2,
                       block_ids=tables[0]),
        ScheduledChunk(request_id="c", new_token_ids=seqs[1], num_computed_tokens=0, state_slot=3,
                       block_ids=tables[1], reset_state=True),
    ]
    out = runner.execute_model(chunks)
    for row, seq in zip(out, [2, 0, 1], strict=True):
        assert relative_error(row, alone[seq][-1]) < TOL[model.dtype], f"sequence {seq}"


def definitional_logits(model, ids: list[int], block_size: int | None) -> torch.Tensor:
    """Logits with AttnRes computed by `tests.models.k3_reference` (None: Full AttnRes) around the model's own
    mixers, FFNs and norms."""
    runner = ModelRunner(model, num_blocks=16, block_size=16, num_slots=2)
    chunk = ScheduledChunk(request_id="r", new_token_ids=ids, num_computed_tokens=0, state_slot=1,
                           block_ids=list(range(16)), reset_state=True)
    x, batch, _ = runner.input_batch.build([chunk])
    eps = model.config.rms_norm_eps

    def mixer(h, layer, cache):
        return layer.self_attn(rms_norm(h, layer.input_layernorm.weight, eps), batch, cache)

    def ffn(h, layer):
        return layer.mlp(rms_norm(h, layer.post_attention_layernorm.weight, eps))

    layers = [(partial(mixer, layer=layer, cache=cache), partial(ffn, layer=layer),
               (layer.self_attention_res.norm, layer.self_attention_res.proj), (layer.mlp_res.norm, layer.mlp_res.proj))
              for layer, cache in zip(model.layers, runner.caches, strict=True)]
    out_w = (model.output_attn_res.norm, model.output_attn_res.proj)
    with torch.inference_mode():
        emb = F.embedding(x, model.embed_tokens)
        if block_size is None:
            h = full_attn_res(emb, layers, out_w, eps)
        else:
            h = block_attn_res(emb, layers, out_w, block_size, eps)
        return model.compute_logits(rms_norm(h, model.norm.weight, eps))


@pytest.mark.parametrize("variant", ["k3", "k3-odd"])
def test_block_attn_res_equals_definition(tiny_dir, variant):
    """The model's Block AttnRes (snapshots + partial, blocks of 3 / 2 layers, a last partial block) equals the
    definition rebuilt from every layer's outputs (fp64)."""
    model = load_model(tiny_dir(variant), dtype=torch.float64)
    ids = prompt_ids(model.config.vocab_size, 40, seed=6)
    ref = definitional_logits(model, ids, model.config.attn_res_block_size)
    assert relative_error(full_logits(model, ids), ref) < 1e-10


def test_block_size_one_equals_full_attn_res(tiny_dir, tmp_path):
    """With attn_res_block_size = 1 the model computes Full AttnRes over decoder-layer outputs (fp64)."""
    path = shutil.copytree(tiny_dir("k3"), tmp_path / "k3-bs1")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["attn_res_block_size"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    model = load_model(path, dtype=torch.float64)
    ids = prompt_ids(model.config.vocab_size, 40, seed=7)
    assert relative_error(full_logits(model, ids), definitional_logits(model, ids, None)) < 1e-10


def test_greedy_generation_through_the_engine(tiny_dir):
    """LLM.generate on the tiny K3 checkpoint with MXFP4 experts: 16 greedy tokens, each the argmax of a full
    forward over the prompt and the tokens so far."""
    path = tiny_dir("k3")
    llm = LLM(model=str(path), dtype="float32")
    ids = prompt_ids(llm.engine.model_config.vocab_size, 12, seed=11)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    model = load_model(path)
    expected = list(ids)
    for _ in range(16):
        expected.append(int(full_logits(model, expected)[-1].argmax()))
    assert out.token_ids == expected[len(ids) :]
    assert len(set(out.token_ids)) > 3, "degenerate continuation: the test would not notice mistakes"
    text = llm.generate("<|open|>message role=\"user\"<|sep|>hi", SamplingParams(max_tokens=4))[0].outputs[0]
    assert len(text.token_ids) >= 1


def test_prefix_cache_hit_equals_miss(tiny_dir):
    """A second request sharing a 40-token prefix reuses K3's KV blocks and fp32-conv KDA checkpoints and continues
    exactly as a cold run (state_checkpoint_interval 16)."""
    path, params = tiny_dir("k3"), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = prompt_ids(1024, 40, seed=12)
    second = first[:32] + prompt_ids(1024, 9, seed=13)
    cold = LLM(model=str(path), state_checkpoint_interval=16, enable_prefix_caching=False).generate([second], params)
    warm_llm = LLM(model=str(path), state_checkpoint_interval=16)
    warm_llm.generate([first], params)
    warm = warm_llm.generate([second], params)[0]
    assert warm.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold[0].outputs[0].token_ids


def test_both_mxfp4_layouts_load_the_same_weights(tiny_dir):
    """compressed-tensors (per-expert weight_packed / weight_scale) and gpt-oss (stacked, interleaved *_blocks /
    *_scales) checkpoints of the same experts load to identical parameters and logits."""
    files = load_file(str(tiny_dir("k3-gpt-oss") / "model.safetensors"))
    assert tuple(files[f"{PREFIX}.1.block_sparse_moe.experts.gate_up_proj_blocks"].shape) == (8, 256, 4, 16)
    a, b = load_model(tiny_dir("k3")), load_model(tiny_dir("k3-gpt-oss"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = prompt_ids(1024, 20, seed=8)
    assert torch.equal(full_logits(a, ids), full_logits(b, ids))


def _edit_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


EXPERT = f"{PREFIX}.2.block_sparse_moe.experts.5"


def _set_format(raw, fmt):
    raw["text_config"]["quantization_config"]["format"] = fmt
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["format"] = fmt


@pytest.mark.parametrize(
    "edit_tensors, edit_config, error, needle",
    [
        (lambda t: t.pop(f"{EXPERT}.w3.weight_scale"), None, WeightLoadError,
         rf"missing.*{EXPERT}\.w3\.weight_scale"),
        (lambda t: t.__setitem__(f"{EXPERT}.w1.weight_packed", torch.zeros(128, 128, dtype=torch.uint8)), None,
         WeightLoadError, rf"{EXPERT}\.w1\.weight_packed.*shape \[128, 128\], expected \[128, 64\]"),
        (lambda t: t.__setitem__(f"{EXPERT}.w2.weight_packed", t[f"{EXPERT}.w2.weight_packed"].float()), None,
         WeightLoadError, rf"{EXPERT}\.w2\.weight_packed.*dtype torch\.float32, expected torch\.uint8"),
        (None, lambda raw: _set_format(raw, "nvfp4-pack-quantized"), ConfigError,
         r"text_config\.quantization_config\.format='nvfp4-pack-quantized'"),
        (None, lambda raw: raw["text_config"].pop("quantization_config"), WeightLoadError,
         r"unexpected tensor.*experts\.\d+\.w\d\.weight_(packed|scale)"),
    ],
    ids=["missing-scale", "packed-shape", "packed-dtype", "unknown-format", "config-says-dense"],
)
def test_bad_k3_checkpoint_names_the_tensor_or_field(tiny_dir, tmp_path, edit_tensors, edit_config, error, needle):
    """A missing MXFP4 scale, a wrong packed shape or dtype, an unknown quantisation format, or packed tensors in a
    checkpoint whose config says dense fail at load with a message naming the tensor or config field."""
    bad = _edit_checkpoint(tiny_dir("k3"), tmp_path / "bad", edit_tensors, edit_config)
    with pytest.raises(error, match=needle):
        load_model(bad)


def test_vision_tensors_are_skipped(tiny_dir, tmp_path):
    """`vision_tower.*` and `mm_projector.*` tensors (the out-of-scope vision part) are ignored by the loader."""
    path = _edit_checkpoint(tiny_dir("k3"), tmp_path / "vl", lambda t: t.update({
        "vision_tower.patch_embed.proj.weight": torch.ones(4, 3), "mm_projector.proj.0.weight": torch.ones(2, 2)}))
    ids = prompt_ids(1024, 12, seed=9)
    assert torch.equal(full_logits(load_model(path), ids), full_logits(load_model(tiny_dir("k3")), ids))


def test_quantize_command_writes_the_mxfp4_checkpoint(tiny_dir, tmp_path):
    """`deltaserve quantize` on a K3 checkpoint with dense experts writes the same tensors as make-tiny's MXFP4
    checkpoint of the same seed, keeps the tokenizer, and refuses an already quantised input."""
    from dataclasses import replace

    from deltaserve.entrypoints.cli import main

    dense = write_tiny_checkpoint(tmp_path / "dense", replace(TINY_VARIANTS["k3"], expert_format="dense"))
    assert main(["--log-level", "WARNING", "quantize", str(dense), str(tmp_path / "q")]) == 0
    ours = load_file(str(tmp_path / "q" / "model.safetensors"))
    ref = load_file(str(tiny_dir("k3") / "model.safetensors"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert (tmp_path / "q" / "tokenizer_config.json").is_file()
    assert load_model(tmp_path / "q").config.quantization.layout == "compressed-tensors"
    with pytest.raises(ValueError, match="already quantised"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq")


def test_mxfp8_activation_flag(tiny_dir, monkeypatch):
    """DELTASERVE_MXFP8_ACTIVATIONS=1 rounds the MXFP4 expert inputs through MXFP8 (off by default). The logits move
    (the perturbed tiny model amplifies the rounding; the layer-level size is checked in tests/layers)."""
    path = tiny_dir("k3")
    ids = prompt_ids(1024, 16, seed=10)
    plain = load_model(path)
    assert plain.layers[1].mlp._linear.keywords["mxfp8_activations"] is False
    monkeypatch.setenv("DELTASERVE_MXFP8_ACTIVATIONS", "1")
    fp8 = load_model(path)
    assert fp8.layers[1].mlp._linear.keywords["mxfp8_activations"] is True
    out, ref = full_logits(fp8, ids), full_logits(plain, ids)
    assert torch.isfinite(out).all() and relative_error(out, ref) > 0
