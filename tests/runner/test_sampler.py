"""Sampler semantics (vLLM v1): penalties, masks, seeded batch invariance, sampling distribution, raw logprobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from deltaserve.ops.sampling import apply_penalties, apply_top_k_top_p_min_p, random_sample, token_counts
from deltaserve.runner.sampler import SamplingRow, TokenBitmask, sample, sampling_probs
from deltaserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def make_row(
    generator: torch.Generator | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    stop: Sequence[int] = (),
    **params: object,
) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), generator=generator, prompt_token_ids=list(prompt),
                       output_token_ids=list(output), stop_token_ids=frozenset(stop))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Hand-made penalty example (all values exact in fp32).
BASE_ROW = [2.0, -1.0, 3.0, 0.5, -2.0, 1.25]
# Row 0: prompt [0, 1], output [2, 2, 3]; repetition 2, presence 0.5, frequency 0.25.
#   0: 2/2 = 1;  1: -1*2 = -2;  2: 3/2 - 0.25*2 - 0.5 = 0.5;  3: 0.5/2 - 0.25 - 0.5 = -0.5;  4, 5 unseen.
PENALISED_0 = [1.0, -2.0, 0.5, -0.5, -2.0, 1.25]
# Row 1: prompt [], output [4]; repetition 0.5, presence -1, frequency 0.  4: -2*0.5 + 1 = 0.
PENALISED_1 = [2.0, -1.0, 3.0, 0.5, 0.0, 1.25]


def test_token_counts_counts_each_packed_row():
    """scatter_add counts: row i gets the occurrences of its own packed slice only (empty rows are zero)."""
    ids = torch.tensor([2, 2, 3, 4, 0])
    counts = token_counts(ids, torch.tensor([0, 3, 3, 5]), vocab_size=6)
    expected = torch.tensor([[0, 0, 2, 1, 0, 0], [0] * 6, [1, 0, 0, 0, 1, 0]])
    assert torch.equal(counts, expected)


def test_apply_penalties_hand_computed():
    """Repetition (prompt or output), frequency and presence penalties equal the hand-computed rows."""
    logits = torch.tensor([BASE_ROW, BASE_ROW])
    before = logits.clone()
    prompt = token_counts(torch.tensor([0, 1]), torch.tensor([0, 2, 2]), 6)
    output = token_counts(torch.tensor([2, 2, 3, 4]), torch.tensor([0, 3, 4]), 6)
    out = apply_penalties(logits, prompt, output, torch.tensor([2.0, 0.5]), torch.tensor([0.5, -1.0]),
                          torch.tensor([0.25, 0.0]))
    assert torch.equal(out, torch.tensor([PENALISED_0, PENALISED_1]))
    assert torch.equal(logits, before)


def test_neutral_penalties_leave_row_bit_identical(gen):
    """Repetition 1, presence 0, frequency 0 change no bit, even for seen tokens and -inf logits."""
    logits = torch.randn(2, 40, generator=gen)
    logits[0, 3] = NEG_INF
    counts = torch.randint(0, 3, (2, 40), generator=gen)
    out = apply_penalties(logits, counts, counts, torch.ones(2), torch.zeros(2), torch.zeros(2))
    assert torch.equal(out, logits)


@pytest.mark.parametrize("penalty", [1e-320, 1e-300, 1e-30, 1e30, 1e300])
def test_extreme_penalties_and_temperature_keep_rows_finite(penalty):
    """A repetition penalty that over- or underflows fp32 (or a near-greedy temperature) leaves finite logits finite
    and masked ones at -inf: no NaN row. Entries that overflow are clamped to the same largest float, so a row with
    one such entry (as here) still samples it; several would tie."""
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0, NEG_INF, 1.0]])
    seen = torch.tensor([[1, 1, 1, 0, 1, 0]])
    out = apply_penalties(logits, seen, torch.zeros_like(seen), torch.tensor([penalty]), torch.zeros(1),
                          torch.zeros(1))
    assert torch.isfinite(out[0, :4]).all() and torch.isfinite(out[0, 5]) and out[0, 4] == NEG_INF
    favoured = 0 if penalty < 1 else 3  # a tiny penalty makes seen positive logits huge; a huge one shrinks them
    assert int(out.argmax()) == favoured
    rows = [make_row(prompt=[0, 1, 2, 4], temperature=temperature, repetition_penalty=penalty, seed=5)
            for temperature in (0.0, 1e-5, 1.0)]
    assert sample(logits.expand(3, -1), rows).token_ids[:2] == [favoured, favoured]


def test_logit_bias_is_added_before_penalties_and_allowed_ids_restrict():
    """logit_bias adds to the raw logit, then the repetition penalty divides it (vLLM's order); ids past the
    vocabulary are ignored. allowed_token_ids leave every other token at -inf, sampled or greedy."""
    logits = torch.tensor([BASE_ROW, BASE_ROW])  # argmax 2 (3.0)
    rows = [make_row(temperature=0.0, logit_bias={5: 2.0, 99: 50.0}),  # 1.25 + 2 = 3.25 beats 3.0
            # (1.25 + 3) / 2 = 2.125 loses to 3.0; penalising first, 1.25 / 2 + 3 = 3.625, would win
            make_row(prompt=[5], temperature=0.0, logit_bias={5: 3.0}, repetition_penalty=2.0)]
    assert sample(logits, rows).token_ids == [5, 2]
    banned = sample(logits, [make_row(temperature=0.0, logit_bias={2: -100.0}), make_row(temperature=0.0)])
    assert banned.token_ids == [0, 2]
    allowed = [make_row(temperature=0.0, allowed_token_ids=[1, 4]),
               make_row(generator=seeded(1), allowed_token_ids=[3, 4], top_k=1)]
    assert sample(logits, allowed).token_ids == [1, 3]
    draws = {sample(logits[:1], [make_row(generator=seeded(s), allowed_token_ids=[3, 5])]).token_ids[0]
             for s in range(40)}
    assert draws == {3, 5}  # both allowed tokens are drawn (p = 0.32 / 0.68), nothing else
    # Only stop tokens allowed while min_tokens masks them: the stop token wins (it used to sample id 0).
    only_stop = make_row(temperature=0.0, allowed_token_ids=[4], stop=[4], min_tokens=3, max_tokens=8)
    assert sample(logits[:1], [only_stop]).token_ids == [4]


def test_grammar_fallback_keeps_allowed_ids():
    """A grammar row that min_tokens leaves empty falls back to the grammar on the allowed ids (not on the raw
    logits, which sampled a disallowed token), and to the grammar alone only when the two are disjoint."""
    logits = torch.tensor([BASE_ROW, BASE_ROW])
    bitmask = torch.tensor([[(1 << 0) | (1 << 4)]] * 2, dtype=torch.int32)  # the grammar allows tokens 0 and 4
    rows = [make_row(temperature=0.0, allowed_token_ids=[4, 5], stop=[4], min_tokens=3, max_tokens=8),
            make_row(temperature=0.0, allowed_token_ids=[5])]
    out = sample(logits, rows, TokenBitmask(row_indices=[0, 1], bitmask=bitmask))
    assert out.token_ids == [4, 0]  # row 0: allowed and grammar share 4; row 1: disjoint, the grammar wins


def test_greedy_is_argmax(gen):
    """Greedy rows without penalties return the argmax of their logits row."""
    logits = torch.randn(6, 51, generator=gen)
    out = sample(logits, [make_row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_with_penalties_is_argmax_of_penalised_row():
    """Greedy with penalties picks the argmax of the hand-penalised row (not of the raw logits)."""
    logits = torch.tensor([BASE_ROW, BASE_ROW])
    rows = [
        make_row(prompt=[0, 1], output=[2, 2, 3], temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                 frequency_penalty=0.25),
        make_row(temperature=0.0),
    ]
    out = sample(logits, rows)
    assert out.token_ids == [max(range(6), key=PENALISED_0.__getitem__), 2]
    assert out.token_ids[0] == 5


def reference_keep(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Per-row fp64 oracle, vLLM v1 order: top-k and min-p on the full distribution, top-p on the survivors."""
    vocab_size = row.numel()
    probs = torch.softmax(row.double(), dim=0)
    keep = torch.ones(vocab_size, dtype=torch.bool)
    if 0 < top_k < vocab_size:
        keep &= row >= torch.topk(row, top_k).values[-1]
    keep &= probs >= min_p * probs.max()
    survivors = torch.where(keep, probs, 0.0)
    survivors = survivors / survivors.sum()
    kept_by_p = torch.zeros(vocab_size, dtype=torch.bool)
    mass = 0.0
    for token in torch.argsort(survivors, descending=True).tolist():
        if mass >= top_p or not keep[token]:
            break
        kept_by_p[token] = True
        mass += survivors[token].item()
    return kept_by_p


FILTER_CASES = {
    "top_k": [(5, 1.0, 0.0)],
    "top_k_minus1": [(-1, 1.0, 0.0)],
    "top_p": [(0, 0.8, 0.0)],
    "min_p": [(0, 1.0, 0.2)],
    "all_three": [(10, 0.7, 0.05)],
    "mixed_rows": [(3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.5), (7, 0.9, 0.1), (0, 1.0, 0.0), (36, 0.95, 0.01),
                   (1, 0.3, 0.0), (0, 1e-6, 0.0), (0, 1.0, 1.0)],
}


@pytest.mark.parametrize("case", list(FILTER_CASES), ids=list(FILTER_CASES))
@pytest.mark.parametrize("scale", [0.5, 3.0], ids=["flat", "peaked"])
def test_top_k_top_p_min_p_mask_matches_per_row_reference(case, scale, gen):
    """The batched one-sort mask keeps exactly the tokens the per-row reference keeps; surviving logits are intact."""
    settings = FILTER_CASES[case] * 3
    logits = torch.randn(len(settings), 37, generator=gen) * scale
    k, p, m = (torch.tensor(col) for col in zip(*settings, strict=True))
    out = apply_top_k_top_p_min_p(logits, k, p, m)
    for i, (top_k, top_p, min_p) in enumerate(settings):
        keep = reference_keep(logits[i], top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(out[i]), keep), (i, top_k, top_p, min_p)
        assert torch.equal(out[i][keep], logits[i][keep])


def test_top_p_keeps_at_least_the_top_token(gen):
    """A tiny top_p (or min_p 1, or top_k 1) keeps exactly the most likely token."""
    logits = torch.randn(3, 29, generator=gen)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0, 0, 1]), torch.tensor([1e-9, 1.0, 1.0]),
                                  torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(torch.isfinite(out), torch.nn.functional.one_hot(logits.argmax(-1), 29).bool())


def random_rows(count: int, gen: torch.Generator) -> list[SamplingRow]:
    """Varied companion rows: greedy, unseeded, seeded, filtered, penalised."""
    choices = [
        lambda: make_row(temperature=0.0),
        lambda: make_row(temperature=1.0),
        lambda: make_row(seeded(99), temperature=0.7, top_k=4),
        lambda: make_row(temperature=1.3, top_p=0.6, min_p=0.05),
        lambda: make_row(prompt=[1, 2], output=[3], temperature=0.9, repetition_penalty=1.2),
    ]
    picks = torch.randint(0, len(choices), (count,), generator=gen).tolist()
    return [choices[c]() for c in picks]


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.1, top_k=20, top_p=0.9, min_p=0.02)],
                         ids=["plain", "filtered"])
def test_seeded_row_is_independent_of_batch(params, gen):
    """Over 20 steps a seeded row gives the same tokens alone, among 5 random rows, and at another position."""
    vocab_size = 97
    target_logits = torch.randn(20, vocab_size, generator=gen)
    alone_gen, first_gen, moved_gen = seeded(1234), seeded(1234), seeded(1234)
    alone, first, moved = [], [], []
    for step in range(20):
        target = target_logits[step : step + 1]
        alone += sample(target, [make_row(alone_gen, **params)]).token_ids
        others = torch.randn(5, vocab_size, generator=gen)
        companions = random_rows(5, gen)
        first.append(sample(torch.cat([target, others]), [make_row(first_gen, **params), *companions]).token_ids[0])
        pos = step % 6
        batch = torch.cat([others[:pos], target, others[pos:]])
        moved.append(sample(batch, [*companions[:pos], make_row(moved_gen, **params), *companions[pos:]])
                     .token_ids[pos])
    assert alone == first == moved


def test_different_seeds_give_different_tokens(gen):
    """Two seeds on the same logits disagree somewhere over 20 draws; the same seed replays exactly."""
    logits = torch.randn(1, 64, generator=gen) * 0.3
    draws = {}
    for name, seed in [("a", 1), ("b", 2), ("a_again", 1)]:
        g = seeded(seed)
        draws[name] = [sample(logits, [make_row(g)]).token_ids[0] for _ in range(20)]
    assert draws["a"] != draws["b"]
    assert draws["a"] == draws["a_again"]


LOGITS_8 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.4, 0.7])


def draw_frequencies(params: dict, num_draws: int = 20_000) -> torch.Tensor:
    """Empirical token frequencies of `num_draws` rows over LOGITS_8 sharing one seeded generator, in one call."""
    g = seeded(7)
    rows = [make_row(g, **params) for _ in range(num_draws)]
    tokens = torch.tensor(sample(LOGITS_8.expand(num_draws, -1), rows).token_ids)
    return torch.bincount(tokens, minlength=8).double() / num_draws


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_distribution_matches_softmax(temperature):
    """20k seeded draws match softmax(logits / T) within 0.02 per token."""
    freq = draw_frequencies(dict(temperature=temperature))
    expected = torch.softmax(LOGITS_8.double() / temperature, dim=0)
    assert (freq - expected).abs().max() < 0.02


def test_top_k_distribution_is_renormalised_top3():
    """With top_k=3 only the 3 best tokens appear, at their renormalised softmax probabilities."""
    freq = draw_frequencies(dict(temperature=1.0, top_k=3))
    best = LOGITS_8.topk(3).indices
    assert set(freq.nonzero().flatten().tolist()) == set(best.tolist())
    expected = torch.softmax(LOGITS_8[best].double(), dim=0)
    assert (freq[best] - expected).abs().max() < 0.02


def test_min_tokens_masks_stop_ids_until_reached():
    """Stop ids (eos and extra ones) are masked while the output is shorter than min_tokens, and not after."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.5, 8.0]])  # 3 = eos, 5 = stop id, both far ahead
    stop = [3, 5, 1000]  # an id beyond the vocabulary is ignored
    picks = [sample(logits, [make_row(output=[4] * n, stop=stop, temperature=0.0, min_tokens=2)]).token_ids[0]
             for n in range(4)]
    assert picks == [2, 2, 3, 3]
    assert sample(logits, [make_row(stop=stop, temperature=0.0)]).token_ids == [3]
    g = seeded(3)
    sampled = {sample(logits, [make_row(g, stop=stop, min_tokens=1)]).token_ids[0] for _ in range(50)}
    assert sampled.isdisjoint({3, 5})


def test_logprobs_are_raw_log_softmax_with_sorted_top_and_rank(gen):
    """Logprobs come from the raw logits; top lists are sorted and sized; ranks are right; the input is untouched."""
    logits = torch.randn(4, 33, generator=gen) * 2
    raw_top = logits[0].argmax().item()
    rows = [
        # min_tokens masks the raw best token, so the greedy pick is a non-top token (rank 2).
        make_row(output=[], stop=[raw_top], temperature=0.0, min_tokens=1, logprobs=5),
        make_row(seeded(5), prompt=[1, 2, 3], output=[4, 4], temperature=1.7, top_p=0.95, repetition_penalty=1.3,
                 frequency_penalty=0.5, logprobs=0),
        make_row(temperature=0.9),
        make_row(seeded(6), temperature=3.0, logprobs=20),
    ]
    before = logits.clone()
    out = sample(logits, rows)
    assert torch.equal(logits, before)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-6)
        assert lp.rank == 1 + int((expected[i] > expected[i, token]).sum())
        assert len(lp.top) == n
        top_values = [v for _, v in lp.top]
        assert top_values == sorted(top_values, reverse=True)
        assert [t for t, _ in lp.top] == expected[i].topk(n).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(expected[i, t].item(), abs=1e-6)
    assert out.logprobs[0].rank == 2
    assert out.logprobs[0].top[0][0] == raw_top


def test_empty_batch_and_shape_check():
    """An empty batch returns empty lists; a row count that does not match the logits raises."""
    out = sample(torch.zeros(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []
    with pytest.raises(ValueError, match="len\\(rows\\)"):
        sample(torch.zeros(2, 10), [make_row()])


def test_bad_words_ban_only_the_completing_token():
    """A one-token bad word is always banned; a longer one only when the output ends with its other tokens."""
    logits = torch.tensor([BASE_ROW, BASE_ROW, BASE_ROW])  # argmax 2, then 0
    rows = [make_row(temperature=0.0, bad_words_token_ids=[[2]]),
            make_row(temperature=0.0, output=[7, 4], bad_words_token_ids=[[4, 2]]),
            make_row(temperature=0.0, output=[4, 7], bad_words_token_ids=[[4, 2], [9, 9, 2]])]
    assert sample(logits, rows).token_ids == [0, 0, 2]


def test_sampling_probs_are_what_sample_draws_from():
    """`sampling_probs` gives each row the distribution `sample` draws from, after every mask and processor: a
    seeded row's token is the exponential race over it with the same generator, a greedy row's is one-hot at
    `sample`'s argmax, a hand-computed row matches, and masked tokens have probability 0."""
    logits = torch.tensor([BASE_ROW] * 6)
    rows = [
        make_row(prompt=[0, 1], output=[2, 2, 3], temperature=0.5, repetition_penalty=2.0, presence_penalty=0.5,
                 frequency_penalty=0.25),  # the hand-computed PENALISED_0, at temperature 0.5
        make_row(output=[1], stop=[2, 5], temperature=0.7, min_tokens=3, top_k=3, logit_bias=((4, 1.5),)),
        make_row(output=[4], temperature=1.3, allowed_token_ids=(0, 1, 2, 4), bad_words_token_ids=[[4, 1]],
                 top_p=0.8, min_p=0.05),
        make_row(temperature=0.9),  # constrained by the grammar below
        make_row(output=[2], temperature=0.0, presence_penalty=2.0),  # greedy: 2 falls to 1.0, below 0's 2.0
        make_row(temperature=0.0, bad_words_token_ids=[[2]], logit_bias=((5, 1.0),)),  # greedy: 5 at 2.25
    ]
    bitmask = TokenBitmask(row_indices=[3], bitmask=torch.tensor([[0b110011]], dtype=torch.int32))
    probs = sampling_probs(logits, rows, bitmask)
    assert probs.shape == (6, 6) and torch.allclose(probs.sum(dim=-1), torch.ones(6))
    assert torch.allclose(probs[0], torch.softmax(torch.tensor(PENALISED_0) / 0.5, dim=-1))
    assert probs[1, [2, 5]].tolist() == [0.0, 0.0] and int((probs[1] > 0).sum()) == 3  # min_tokens, then top-k 3
    assert probs[2, [1, 3, 5]].tolist() == [0.0, 0.0, 0.0]  # outside allowed ids; 1 completes a bad word
    assert probs[3, [2, 3]].tolist() == [0.0, 0.0] and bool((probs[3, [0, 1, 4, 5]] > 0).all())
    assert probs[4].tolist() == [1.0, 0, 0, 0, 0, 0] and probs[5].tolist() == [0, 0, 0, 0, 0, 1.0]
    for seed in range(20):
        gens = [seeded(seed + k) for k in range(4)] + [None, None]
        replay = [seeded(seed + k) for k in range(4)]
        tokens = sample(logits, [dataclasses.replace(r, generator=g) for r, g in zip(rows, gens, strict=True)],
                        bitmask).token_ids
        assert tokens[:4] == [int(random_sample(probs[k:k + 1], [replay[k]])[0]) for k in range(4)]
        assert tokens[4:] == [0, 5]
