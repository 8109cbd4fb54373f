"""Helpers shared by the model, runner and engine tests."""

from __future__ import annotations

import torch

from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """n random token ids below the special tokens (which sit at the top of the tiny vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 32, (n,), generator=g).tolist()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """deltaserve logits for every prompt position, through the runner's real batch building (scattered blocks)."""
    runner = ModelRunner(model, num_blocks=16, block_size=16, num_slots=2)
    blocks = [3, 0, 5, 1, 7, 2, 9, 4, 11, 6, 13, 8, 15, 10, 12, 14]
    chunk = ScheduledChunk(request_id="r", new_token_ids=ids, num_computed_tokens=0, state_slot=1, block_ids=blocks)
    x, batch, _ = runner.input_batch.build([chunk])
    with torch.inference_mode():
        return model.compute_logits(model(x, batch, runner.caches))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, rejecting NaN."""
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out - ref).abs().max() / ref.abs().max()).item()


def hf_greedy(hf_model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy `generate` of exactly `num_tokens` tokens (eos ignored; an explicit all-ones attention
    mask, since a pad id inside the prompt would otherwise be masked out)."""
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()
