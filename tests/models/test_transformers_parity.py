"""Parity with the implementation we did not write: transformers' KimiLinearForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.models.loader import load_model
from tests.helpers import full_logits, hf_greedy, prompt_ids, relative_error

transformers = pytest.importorskip("transformers")

VARIANTS = ["base", "qlora-2shared-bsmoe", "odd-sizes", "no-dense-4groups"]


def hf_model(path):
    model, info = transformers.KimiLinearForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_logits_match_transformers(tiny_dir, variant):
    """Full-prompt fp32 logits agree with transformers to 1e-4 relative error."""
    path = tiny_dir(variant)
    ours = load_model(path, dtype=torch.float32)
    ids = prompt_ids(ours.config.vocab_size, 40, seed=7)
    with torch.inference_mode():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].float()
    out = full_logits(ours, ids)
    rel = relative_error(out, ref)
    assert rel < 1e-4, f"{variant}: max relative logit error {rel:.2e}"
    assert ref.abs().max() > 2.0, "logits too flat to be a sensitive test"
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_continuation_matches_transformers_generate(tiny_dir, variant):
    """32 greedy tokens from LLM.generate are identical to transformers' generate."""
    path = tiny_dir(variant)
    llm = LLM(model=str(path), dtype="float32")
    ids = prompt_ids(llm.engine.model_config.vocab_size, 12, seed=11)
    ref = hf_greedy(hf_model(path), ids, 32)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref
    assert len(set(ref)) > 3, "degenerate continuation: the test would not notice mistakes"
