"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs): each prompt token's logprob given the
tokens before it equals transformers' full-prompt log-softmax, under chunked prefill and preemption, and such a
request is never served from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from tests.helpers import prompt_ids

transformers = pytest.importorskip("transformers")


def reference(path, ids: list[int]) -> torch.Tensor:
    """[T - 1, V] log-softmax of transformers' logits at positions 0..T-2 (predicting tokens 1..T-1)."""
    model = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               experts_implementation="eager").eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def test_prompt_logprobs_match_transformers_under_chunking(tiny_dir):
    """Chunks of 24 tokens over a 70-token prompt: 69 entries (the first token has none), each the reference's
    logprob of the prompt token, with its rank and top-3; a second identical request recomputes (no cache hit)."""
    path = tiny_dir("base")
    llm = LLM(model=str(path), max_num_batched_tokens=24)
    ids = prompt_ids(llm.engine.model_config.vocab_size, 70, seed=21)
    ref = reference(path, ids)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    first, second = llm.generate([ids], params)[0], llm.generate([ids], params)[0]
    assert second.num_cached_tokens == 0  # the first run cached this prompt; a prompt-logprobs request skips it
    for out in (first, second):
        entries = out.prompt_logprobs
        assert entries[0] is None and len(entries) == len(ids)
        targets = torch.tensor(ids[1:])
        ours = torch.tensor([e.logprob for e in entries[1:]])
        expected = ref.gather(1, targets[:, None]).squeeze(1)
        assert torch.allclose(ours, expected, atol=2e-4), (ours - expected).abs().max()
        assert [e.token_id for e in entries[1:]] == ids[1:]
        assert [e.rank for e in entries[1:]] == (1 + (ref > expected[:, None]).sum(-1)).tolist()
        assert [[t for t, _ in e.top] for e in entries[1:]] == ref.topk(3, dim=-1).indices.tolist()
    plain = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_dir):
    """With a cache too small for all requests, preempted requests recompute their prompts: each still reports
    exactly one entry per prompt token, equal to a run without preemption."""
    path = str(tiny_dir("base"))
    prompts = [prompt_ids(1024, 40, seed=s) for s in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    roomy = LLM(model=path).generate(prompts, params)
    tight_llm = LLM(model=path, num_blocks=12, max_num_seqs=4)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert len(b.prompt_logprobs) == 40
        assert [e.logprob for e in b.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in a.prompt_logprobs[1:]],
                                                                           abs=1e-4)
