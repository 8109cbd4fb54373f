"""The grammar bitmask in the sampler: the op against a per-token reading of the bits, constrained rows only, after
min_tokens masking and before penalties / temperature, logprobs from the raw logits."""

from __future__ import annotations

import torch

from deltaserve.ops.sampling import apply_token_bitmask
from deltaserve.runner.sampler import SamplingRow, TokenBitmask, sample
from deltaserve.sampling_params import SamplingParams
from deltaserve.structured import allocate_bitmask
from deltaserve.structured.backend import set_allowed

V = 100


def row(params: SamplingParams, output: list[int] | None = None, stops=frozenset({7})) -> SamplingRow:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params=params, generator=gen, prompt_token_ids=[1, 2, 3], output_token_ids=output or [],
                       stop_token_ids=stops)


def bitmask_of(allowed: list[list[int]], vocab: int = V) -> torch.Tensor:
    bitmask = allocate_bitmask(len(allowed), vocab)
    for i, ids in enumerate(allowed):
        set_allowed(bitmask, i, ids)
    return bitmask


def test_op_matches_bit_by_bit_reading():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=g)
    out = apply_token_bitmask(logits, bitmask)
    for r in range(3):
        for t in range(70):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert out[r, t] == (logits[r, t] if allowed else float("-inf"))
    assert torch.equal(apply_token_bitmask(logits, torch.full((3, 3), -1, dtype=torch.int32)), logits)


def test_only_constrained_rows_change_and_greedy_takes_best_allowed():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    greedy = SamplingParams(temperature=0.0)
    rows = [row(greedy), row(greedy), row(greedy)]
    free = sample(logits, rows)
    allowed = [5, 17, 60]
    out = sample(logits, rows, TokenBitmask(row_indices=[1], bitmask=bitmask_of([allowed])))
    assert out.token_ids[0] == free.token_ids[0] and out.token_ids[2] == free.token_ids[2]
    assert out.token_ids[1] == max(allowed, key=lambda t: logits[1, t].item())


def test_sampled_rows_stay_inside_the_mask_and_seeded_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=g)
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=11, presence_penalty=0.5)
    allowed = [3, 9, 40, 41, 99]
    alone = sample(logits[2:3], [row(params)], TokenBitmask([0], bitmask_of([allowed])))
    rows = [row(SamplingParams(temperature=1.0)), row(SamplingParams(temperature=0.0)), row(params),
            row(SamplingParams(temperature=0.7, seed=3))]
    tokens = []
    for _ in range(20):
        rows[2] = row(params)
        out = sample(logits, rows, TokenBitmask([2, 3], bitmask_of([allowed, [50]])))
        tokens.append(out.token_ids[2])
        assert out.token_ids[3] == 50
    assert set(tokens) <= set(allowed)
    assert tokens[0] == alone.token_ids[0]


def test_mask_after_min_tokens_and_logprobs_from_raw_logits():
    """min_tokens masks stop token 7; the grammar allows {7, 8}: 8 wins. If the grammar allows only the stop token,
    the grammar wins over min_tokens (no row is left without a token). Logprobs come from the raw logits."""
    logits = torch.zeros(2, V)
    logits[:, 7], logits[:, 8] = 5.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, logprobs=1)
    out = sample(logits, [row(params), row(params)], TokenBitmask([0, 1], bitmask_of([[7, 8], [7]])))
    assert out.token_ids == [8, 7]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert abs(out.logprobs[0].logprob - raw[8].item()) < 1e-6
    assert out.logprobs[0].top[0][0] == 7  # the unconstrained favourite, as vLLM reports it


def test_penalties_apply_after_the_mask():
    """A repetition penalty still ranks the allowed tokens: the best allowed token after the penalty wins."""
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 20] = 4.0, 3.0  # token 1 is in the prompt: 4 / 2 = 2 < 3
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = sample(logits, [row(params)], TokenBitmask([0], bitmask_of([[1, 20, 30]])))
    assert out.token_ids == [20]
