"""`ModelRunner(rejection_sample_method="block")`: proposals with draft distributions are verified jointly
(`ops.sampling.block_rejection_sample`) against the target's final distributions at every position, and the output
keeps the distribution of plain sampling; chunks without draft distributions keep the token-wise rounds.

The runner samples whatever logits it is handed, so these tests call its `_sample` with synthetic logits over a
4-token vocabulary: the logits of position j depend on the proposals before it (a context-dependent target), and a
presence penalty makes the sampler's distribution depend on them again, as output tokens. With a context-dependent
draft, NUM_TRIALS seeded requests (one block of 2 proposals each, extended by exact target sampling to 3 tokens)
must match the exact joint of 3 target tokens: a chi-square goodness-of-fit test at ALPHA, over all 64 sequences.
Every seed is fixed, so the outcome is the same on every run (measured: p = 0.45; other seeds 0.02 to 0.25, and 0.93
with 5x the trials). Power, measured by patching: the op's residual replaced by the target row (p = 2e-79), and the
runner leaving the proposals out of the penalties' output tokens (p = 8e-42), both fail.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deltaserve.models.loader import load_model
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import NewRequestData, ScheduledChunk, SchedulerOutput

VOCAB = 4
NUM_PROPOSED = 2
NUM_TRIALS = 6000
ALPHA = 1e-3
PRESENCE = 0.8
TEMPERATURE = 0.9
PROMPT = [1, 2]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("base"))


def runner_of(model, method: str = "block") -> ModelRunner:
    return ModelRunner(model, num_blocks=4, block_size=16, num_slots=2, rejection_sample_method=method)


def table(seed: int, max_len: int, scale: float = 1.5) -> dict[tuple[int, ...], torch.Tensor]:
    """A random fp32 ``[VOCAB]`` row per prefix of length 0..max_len."""
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(VOCAB, generator=g) for n in range(max_len + 1)
            for k in itertools.product(range(VOCAB), repeat=n)}


LOGITS = table(seed=0, max_len=NUM_PROPOSED)
"""The target's raw logits after each output prefix."""
DRAFT = {k: torch.softmax(v, dim=-1) for k, v in table(seed=1, max_len=NUM_PROPOSED - 1, scale=1.0).items()}
"""The draft's distribution after each output prefix (not the target's)."""


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    """The exact next-token distribution after `prefix` (all of the output): presence penalty, then temperature."""
    seen = torch.zeros(VOCAB)
    seen[list(prefix)] = 1.0
    return torch.softmax((LOGITS[prefix].double() - PRESENCE * seen.double()) / TEMPERATURE, dim=-1)


def register(runner: ModelRunner, ids: list[str], **params: object) -> None:
    """Start requests in the runner (no forward: a step with no chunks)."""
    runner.execute(SchedulerOutput(chunks=[], new_requests=[
        NewRequestData(request_id=rid, prompt_token_ids=PROMPT, params=SamplingParams(seed=k, **params),
                       stop_token_ids=frozenset({0})) for k, rid in enumerate(ids)]))


def chunk(rid: str, proposed: list[int]) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, new_token_ids=[1, *proposed], num_computed_tokens=len(PROMPT),
                          state_slot=0, block_ids=[0], num_proposed=len(proposed))


def block_logits(proposed: list[int]) -> torch.Tensor:
    """``[1 + n, VOCAB]``: the target's raw logits at positions 0..n, given the proposals before each."""
    return torch.stack([LOGITS[tuple(proposed[:j])] for j in range(len(proposed) + 1)])


def draw_proposals(g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    proposed: list[int] = []
    rows = []
    for _ in range(NUM_PROPOSED):
        rows.append(DRAFT[tuple(proposed)])
        proposed.append(int(torch.multinomial(rows[-1], 1, generator=g)))
    return proposed, torch.stack(rows)


def chi_square_goodness_of_fit(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]
                               ) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of `counts` against `probs`; cells expecting < 5 are pooled."""
    total = sum(counts.values())
    big = [k for k in probs if probs[k] * total >= 5]
    observed = [counts.get(k, 0) for k in big] + [total - sum(counts.get(k, 0) for k in big)]
    expected = [probs[k] * total for k in big] + [total * (1 - sum(probs[k] for k in big))]
    if expected[-1] < 5:  # the pool joins the last big cell
        observed[-2:] = [observed[-2] + observed[-1]]
        expected[-2:] = [expected[-2] + expected[-1]]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, df, p


def test_block_mode_keeps_the_target_distribution(model):
    """Seeded requests verifying sampled proposals by blocks, continued by target sampling to 3 tokens, match the
    exact 3-token target joint; some blocks accept both proposals, some none."""
    runner = runner_of(model)
    ids = [f"r{k}" for k in range(NUM_TRIALS)]
    register(runner, ids, temperature=TEMPERATURE, presence_penalty=PRESENCE, max_tokens=8)
    g = torch.Generator().manual_seed(2)
    counts: dict[tuple[int, ...], int] = {}
    num_accepted = []
    for batch in range(0, NUM_TRIALS, 500):
        chunks, logits, draft_probs = [], [], {}
        for rid in ids[batch:batch + 500]:
            proposed, q = draw_proposals(g)
            chunks.append(chunk(rid, proposed))
            logits.append(block_logits(proposed))
            draft_probs[rid] = q
        out = SchedulerOutput(chunks=chunks, draft_probs=draft_probs)
        result = runner._sample(torch.cat(logits), chunks, out)
        for c in chunks:
            tokens = [t.token_id for t in result[c.request_id]]
            assert tokens[:-1] == c.new_token_ids[1:len(tokens)]  # the accepted proposals, then one more
            assert runner._requests[c.request_id].output_token_ids == tokens
            num_accepted.append(len(tokens) - 1)
            while len(tokens) < NUM_PROPOSED + 1:
                tokens.append(int(torch.multinomial(target(tuple(tokens)).float(), 1, generator=g)))
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    exact = {seq: math.prod(float(target(seq[:k])[t]) for k, t in enumerate(seq))
             for seq in itertools.product(range(VOCAB), repeat=NUM_PROPOSED + 1)}
    stat, df, p = chi_square_goodness_of_fit(counts, exact)
    print(f"chi2={stat:.1f} df={df} p={p:.3g}; accepted per block {sum(num_accepted) / NUM_TRIALS:.3f}")
    assert set(num_accepted) == set(range(NUM_PROPOSED + 1))
    assert df >= 30 and p >= ALPHA, f"block verification moved the distribution: chi2={stat:.1f} df={df} p={p:.3g}"


def rollout(logits: torch.Tensor, proposed: list[int]) -> list[int]:
    """Plain greedy verification: argmax at each position while it equals the proposal, then one more."""
    tokens = []
    for j in range(len(proposed) + 1):
        tokens.append(int(logits[j].argmax()))
        if j == len(proposed) or tokens[-1] != proposed[j]:
            break
    return tokens


def test_greedy_and_deterministic_chunks_are_unchanged_in_block_mode(model):
    """In one call with a block-verified chunk: a greedy chunk (its proposals with and without draft
    distributions) gives exactly plain greedy verification's tokens, and a seeded chunk with deterministic proposals
    gives the tokens of standard mode."""
    g = torch.Generator().manual_seed(5)
    sampled_proposed, sampled_q = draw_proposals(g)
    greedy_logits = torch.randn(3, VOCAB, generator=g)
    greedy_proposed = [int(greedy_logits[0].argmax()), (int(greedy_logits[1].argmax()) + 1) % VOCAB]
    chunks = [chunk("block", sampled_proposed), chunk("greedy", greedy_proposed),
              chunk("greedy_q", greedy_proposed), chunk("ngram", greedy_proposed)]
    logits = torch.cat([block_logits(sampled_proposed), greedy_logits, greedy_logits, greedy_logits])
    q = torch.full((NUM_PROPOSED, VOCAB), 1 / VOCAB)
    results = {}
    for method in ("block", "standard"):
        runner = runner_of(model, method)
        register(runner, ["block", "ngram"], temperature=TEMPERATURE)
        register(runner, ["greedy", "greedy_q"], temperature=0.0)
        out = SchedulerOutput(chunks=chunks, draft_probs={"block": sampled_q, "greedy_q": q})
        results[method] = {rid: [t.token_id for t in toks] for rid, toks in runner._sample(logits, chunks, out).items()}
    expected = rollout(greedy_logits, greedy_proposed)
    assert len(expected) == 2
    for method in ("block", "standard"):
        assert results[method]["greedy"] == expected and results[method]["greedy_q"] == expected
    assert results["block"]["ngram"] == results["standard"]["ngram"]


def test_block_mode_masks_each_position_and_returns_raw_logprobs(model):
    """Each position gets its own grammar mask row and the min_tokens stop mask of the proposals before it; each
    returned token carries the logprob, rank and top alternatives of its raw logits row."""
    runner = runner_of(model)
    ids = [f"r{k}" for k in range(60)]
    register(runner, ids, temperature=TEMPERATURE, min_tokens=2, logprobs=2)
    allowed = [0b1111, 0b1001, 0b1111]  # position 1 allows tokens 0 and 3 only
    g = torch.Generator().manual_seed(7)
    chunks, logits, draft_probs = [], [], {}
    for rid in ids:
        proposed, q = draw_proposals(g)
        chunks.append(chunk(rid, proposed))
        logits.append(block_logits(proposed))
        draft_probs[rid] = q
    bitmask = torch.tensor(allowed * len(ids), dtype=torch.int32)[:, None]  # [3 R, 1]
    out = SchedulerOutput(chunks=chunks, draft_probs=draft_probs, structured_request_ids=ids, grammar_bitmask=bitmask)
    result = runner._sample(torch.cat(logits), chunks, out)
    lengths = set()
    for c, rows in zip(chunks, logits, strict=True):
        tokens = result[c.request_id]
        lengths.add(len(tokens))
        assert tokens[0].token_id != 0  # min_tokens: no stop token with 0 output tokens...
        if len(tokens) > 1:
            assert tokens[1].token_id == 3  # ... nor with 1; the grammar leaves token 3
        raw = torch.log_softmax(rows, dim=-1)
        for j, t in enumerate(tokens):
            assert t.logprobs is not None and t.logprobs.token_id == t.token_id
            assert t.logprobs.logprob == pytest.approx(float(raw[j, t.token_id]), abs=1e-6)
            assert t.logprobs.rank == 1 + int((raw[j] > raw[j, t.token_id]).sum())
            assert [i for i, _ in t.logprobs.top] == raw[j].topk(2).indices.tolist()
    assert lengths == {1, 2, 3}


def test_unknown_rejection_sample_method_is_refused(model):
    with pytest.raises(ValueError, match="rejection_sample_method"):
        runner_of(model, "blocky")
