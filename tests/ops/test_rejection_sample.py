"""`ops.sampling.rejection_sample` keeps the target distribution (issue 17).

The convergence test follows the idea of vLLM's `test_rejection_sampling_approximates_target_distribution`: draw
draft tokens from a known q, verify them against a known p with the real op, and watch the L2 distance between the
output histogram and p shrink as samples grow (as the multinomial noise, ``sqrt((1 - sum p^2) / n)``), while the
distance to random reference distributions stays put. Unit checks: a draft equal to the target is always accepted,
a token the target excludes is never returned, a seeded row's token depends only on its own generator, and
mismatched shapes raise ValueError. Every draw comes from a fixed seed: the results are the same on every run.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.sampling import rejection_sample

VOCAB = 10
SAMPLE_SIZES = [10, 100, 1_000, 10_000, 100_000]
NUM_REFERENCES = 100
IMPROVEMENT_FACTOR = 20
"""From 10 to 100,000 samples the distance to the target must fall at least this many times more than the (mean)
distance to the random references (vLLM's factor). The noise alone falls ~100x; the references' about 1x."""
NOISE_MARGIN = 4.0
"""At every sample size the distance to the target stays below this many times its expected multinomial size."""


def _distributions(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q), [V] each: the target and the draft distribution of a test case."""
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(2.0 * torch.randn(VOCAB, generator=g), dim=-1)
    q = torch.softmax(2.0 * torch.randn(VOCAB, generator=g), dim=-1)
    if case == "top_k_target":
        # As after top-k = 4: the target excludes tokens the draft proposes (their residual mass is 0; the
        # rejections there must be redistributed over the other tokens).
        p = torch.where(p >= p.topk(4).values[-1], p, 0.0)
        p = p / p.sum()
    elif case == "draft_equals_target":
        q = p.clone()
    elif case == "draft_outside_target":
        # Half of the draft's mass sits where the target has none.
        p = torch.where(torch.arange(VOCAB) < VOCAB // 2, p, 0.0)
        p = p / p.sum()
        q = torch.where(torch.arange(VOCAB) < VOCAB // 2, 0.5 * q / q[: VOCAB // 2].sum(),
                        0.5 * q / q[VOCAB // 2:].sum())
    return p, q


def _output_histogram(p: torch.Tensor, q: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
    """Empirical distribution ``[V]`` of `rejection_sample` over `num_samples` rows, drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, num_samples, replacement=True, generator=g)  # [n]
    probs = p.expand(num_samples, VOCAB)
    draft_probs = q.expand(num_samples, VOCAB)
    # Unseeded rows draw (batched) from the default generator: seeded here, and restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        out = rejection_sample(probs, draft_probs, drafts, [None] * num_samples)
    assert out.shape == (num_samples,) and out.dtype == torch.int64
    return torch.bincount(out, minlength=VOCAB).double() / num_samples


@pytest.mark.parametrize("case", ["random", "top_k_target", "draft_equals_target", "draft_outside_target"])
def test_rejection_sampling_approximates_target_distribution(case: str) -> None:
    p, q = _distributions(case)
    references = torch.softmax(torch.rand(NUM_REFERENCES, VOCAB, generator=torch.Generator().manual_seed(7)), dim=-1)
    p64, noise = p.double(), (1.0 - (p.double() ** 2).sum()).sqrt().item()
    to_target, to_references = [], []
    for n in SAMPLE_SIZES:
        hist = _output_histogram(p, q, n, seed=n)
        assert hist[p == 0].sum() == 0, "a token outside the target's support was returned"
        to_target.append((hist - p64).norm().item())
        to_references.append((hist - references.double()).norm(dim=-1).mean().item())
        # E ||hist - p||^2 = (1 - sum p^2) / n for n independent draws from p.
        assert to_target[-1] <= NOISE_MARGIN * noise / n**0.5, (
            f"n={n}: L2 distance to the target {to_target[-1]:.4g} > {NOISE_MARGIN} x noise {noise / n**0.5:.4g}")
    target_gain = to_target[0] / to_target[-1]
    reference_gain = to_references[0] / to_references[-1]
    assert target_gain > IMPROVEMENT_FACTOR * reference_gain, (
        f"distance to target fell {target_gain:.1f}x, to references {reference_gain:.2f}x "
        f"(need > {IMPROVEMENT_FACTOR}x more); to target {to_target}, to references {to_references}")
    if case != "draft_equals_target":  # the output follows p, not the draft's q
        assert to_target[-1] < (hist - q.double()).norm().item() / 10


def test_draft_equal_to_target_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    rows = 2000
    logits = 3.0 * torch.randn(rows, VOCAB, generator=g)
    masked = torch.rand(rows, VOCAB, generator=g) < 0.4
    masked[:, 0] = False
    logits = logits.masked_fill(masked, float("-inf"))  # some zeros in p
    p = torch.softmax(logits, dim=-1)
    drafts = torch.multinomial(p, 1, generator=g).squeeze(1)
    generators = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(rows)]
    out = rejection_sample(p, p.clone(), drafts, generators)
    assert torch.equal(out, drafts)


def test_token_the_target_excludes_is_never_returned() -> None:
    g = torch.Generator().manual_seed(1)
    rows = 4000
    p = torch.softmax(torch.randn(rows, VOCAB, generator=g), dim=-1)
    excluded = torch.rand(rows, VOCAB, generator=g) < 0.5
    excluded[:, 0] = False  # every row keeps some support
    p = p.masked_fill(excluded, 0.0)
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.softmax(torch.randn(rows, VOCAB, generator=g), dim=-1)
    q[: rows // 4] = excluded[: rows // 4].float()  # a quarter of the drafts lie wholly outside p
    keep = q.sum(dim=-1) > 0  # such a row whose mask excluded nothing has no draft distribution: dropped
    q = q / q.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    p, q = p[keep], q[keep]
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    generators = [torch.Generator().manual_seed(i) if i % 3 == 0 else None for i in range(p.shape[0])]
    out = rejection_sample(p, q, drafts, generators)
    assert bool((p.gather(1, out[:, None]) > 0).all()), "returned a token with p(x) = 0"
    outside = p.gather(1, drafts[:, None]).squeeze(1) == 0
    assert int(outside.sum()) > rows // 4, "the test must propose many tokens the target excludes"
    assert not bool((out[outside] == drafts[outside]).any())
    assert bool((out[~outside] == drafts[~outside]).any()), "some drafts inside the support are accepted"


def _seeded_rows(num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(2.0 * torch.randn(num_rows, VOCAB, generator=g), dim=-1)
    q = torch.softmax(2.0 * torch.randn(num_rows, VOCAB, generator=g), dim=-1)
    return p, q, torch.multinomial(q, 1, generator=g).squeeze(1)


def test_seeded_rows_depend_only_on_their_own_generator() -> None:
    """Row i's token (and how far its generator advanced) is the same alone, in a batch, in any order, and next to
    unseeded rows; only its own seed matters."""
    num_rows = 64
    p, q, drafts = _seeded_rows(num_rows)

    def run(order: list[int], unseeded_every: int = 0) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """Rows `order` (seeded with 100 + row) in that order, an unseeded copy of row 0 after every
        `unseeded_every` of them; returns each seeded row's token and its generator's state afterwards."""
        picked: list[int] = []
        gens: list[torch.Generator | None] = []
        for n, i in enumerate(order):
            picked.append(i)
            gens.append(torch.Generator().manual_seed(100 + i))
            if unseeded_every and n % unseeded_every == 0:
                picked.append(0)
                gens.append(None)
        idx = torch.tensor(picked)
        out = rejection_sample(p[idx], q[idx], drafts[idx], gens).tolist()
        tokens = {i: t for i, t, gen in zip(picked, out, gens, strict=True) if gen is not None}
        states = {i: gen.get_state() for i, gen in zip(picked, gens, strict=True) if gen is not None}
        return tokens, states

    batched, batched_states = run(list(range(num_rows)))
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(3)).tolist()
    alone = [run([i]) for i in range(num_rows)]
    for tokens, states in [run(perm), run(perm[::-1], unseeded_every=3), run(perm[:20]), *alone]:
        for i, token in tokens.items():
            assert token == batched[i], f"row {i}: {token} here, {batched[i]} in the ordered batch"
            assert torch.equal(states[i], batched_states[i]), f"row {i}: its generator advanced differently"
    # The seeds matter: other seeds give other tokens for some rows (the test is not vacuous).
    with torch.random.fork_rng(devices=[]):
        other = rejection_sample(p, q, drafts, [torch.Generator().manual_seed(9000 + i) for i in range(num_rows)])
    assert other.tolist() != [batched[i] for i in range(num_rows)]


@pytest.mark.parametrize("bad", ["draft_probs_vocab", "draft_probs_rows", "draft_ids_2d", "draft_ids_rows",
                                 "generators"])
def test_shape_errors_raise_value_error(bad: str) -> None:
    p, q, drafts = _seeded_rows(4)
    gens: list[torch.Generator | None] = [None] * 4
    if bad == "draft_probs_vocab":
        q = torch.cat([q, torch.zeros(4, 1)], dim=1)
    elif bad == "draft_probs_rows":
        q = q[:3]
    elif bad == "draft_ids_2d":
        drafts = drafts[:, None]
    elif bad == "draft_ids_rows":
        drafts = drafts[:3]
    else:
        gens = gens[:3]
    with pytest.raises(ValueError, match="rejection_sample"):
        rejection_sample(p, q, drafts, gens)
