"""`ops.sampling.block_rejection_sample` (block verification, Sun et al. 2024) keeps the target distribution exactly
and accepts at least as many drafts as token-wise verification.

Exact, not sampled: for a small vocabulary every draft block is enumerated, and the uniforms are integrated out
analytically from the op's own acceptance weights (`_block_verification`: tau = i with probability
``h_i * prod_{j > i} (1 - h_j)``). The emitted tokens (tau drafts and the token after them), continued by target
sampling to n + 1 tokens, must have the target's joint distribution to 1e-12. A replay test then pins the public op
to those weights: with a cloned generator, n uniforms and one exponential race reproduce its (tau, token) and its
final generator state. Targets depend on the prefix; drafts depend on it (a draft model) or only on the position
(a parallel block drafter). Every draw comes from a fixed seed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from deltaserve.ops.sampling import block_rejection_sample, random_sample
from deltaserve.ops.sampling.ref import _block_verification

Prefix = tuple[int, ...]
Table = Callable[[Prefix], torch.Tensor]
"""prefix -> ``[V]`` float64 distribution of the next token."""


def _random_table(vocab: int, max_len: int, seed: int, zeros: int = 0, by_position: bool = False) -> Table:
    """A distribution per prefix of length 0..max_len (or per position only: `by_position`), random with a fixed
    seed; `zeros` entries of each set to 0 (as after top-k) and the rest renormalised."""
    g = torch.Generator().manual_seed(seed)
    keys: list[Prefix] | list[int]
    if by_position:
        keys = list(range(max_len + 1))
    else:
        keys = [k for length in range(max_len + 1) for k in itertools.product(range(vocab), repeat=length)]
    table = {}
    for key in keys:
        p = torch.softmax(1.5 * torch.randn(vocab, generator=g, dtype=torch.float64), dim=-1)
        if zeros:
            p[torch.randperm(vocab, generator=g)[:zeros]] = 0.0
            p = p / p.sum()
        table[key] = p
    return (lambda prefix: table[len(prefix)]) if by_position else (lambda prefix: table[prefix])


def _case(name: str) -> tuple[int, int, Table, Table]:
    """(V, n, target, draft) of a named case."""
    if name == "paper_example":  # Sun et al., section 3: context-free, E[tau] 10/9 token-wise, 11/9 block
        p, q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
        return 2, 2, (lambda prefix: p), (lambda prefix: q)
    if name == "prefix_dependent_draft":
        return 3, 3, _random_table(3, 3, seed=1), _random_table(3, 2, seed=2)
    if name == "prefix_independent_draft":
        return 4, 3, _random_table(4, 3, seed=3), _random_table(4, 2, seed=4, by_position=True)
    if name == "sparse_target":  # the target excludes tokens the draft proposes, and the reverse
        return 4, 2, _random_table(4, 2, seed=5, zeros=2), _random_table(4, 1, seed=6, zeros=1)
    if name == "draft_equals_target":
        target = _random_table(3, 3, seed=7)
        return 3, 3, target, target
    raise AssertionError(name)


CASES = ["paper_example", "prefix_dependent_draft", "prefix_independent_draft", "sparse_target",
         "draft_equals_target"]


def _block(target: Table, draft: Table, drafts: Prefix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's inputs for one draft block: target rows at positions 0..n, draft rows 1..n, the ids."""
    n = len(drafts)
    return (torch.stack([target(drafts[:j]) for j in range(n + 1)]),
            torch.stack([draft(drafts[:j]) for j in range(n)]).reshape(n, -1),
            torch.tensor(drafts, dtype=torch.long))


def _tau_probabilities(weights: list[float]) -> list[float]:
    """P(tau = i), i = 0..n, for tau = max {i : eta_i < h_i} with independent uniforms eta_i."""
    n = len(weights)
    return [(weights[i - 1] if i else 1.0) * math.prod(1 - h for h in weights[i:]) for i in range(n + 1)]


def _draft_probability(draft: Table, drafts: Prefix) -> float:
    return math.prod(float(draft(drafts[:j])[t]) for j, t in enumerate(drafts))


def _exact_output(vocab: int, n: int, target: Table, draft: Table) -> tuple[dict[Prefix, float], float, float]:
    """The distribution of the first n + 1 tokens (the block's emitted tokens, then target sampling), and E[tau] of
    block and of token-wise verification, each summed exactly over every draft block."""
    out: dict[Prefix, float] = dict.fromkeys(itertools.product(range(vocab), repeat=n + 1), 0.0)
    block_tau = token_tau = 0.0
    for drafts in itertools.product(range(vocab), repeat=n):
        q_block = _draft_probability(draft, drafts)
        if q_block == 0:
            continue
        target_rows, draft_rows, ids = _block(target, draft, drafts)
        weights, final = _block_verification(target_rows, draft_rows, ids)
        tau_probs = _tau_probabilities(weights.tolist())
        block_tau += q_block * sum(i * pr for i, pr in enumerate(tau_probs))
        ratios = [min(1.0, float(target_rows[j, t] / draft_rows[j, t])) for j, t in enumerate(drafts)]
        token_tau += q_block * sum(math.prod(ratios[:i]) for i in range(1, n + 1))
        for tau, pr in enumerate(tau_probs):
            if pr == 0:
                continue
            following = (final[tau] / final[tau].sum()).tolist()
            for seq in itertools.product(range(vocab), repeat=n + 1):
                if seq[:tau] != drafts[:tau] or following[seq[tau]] == 0:
                    continue
                rest = math.prod(float(target(seq[:k])[seq[k]]) for k in range(tau + 1, n + 1))
                out[seq] += q_block * pr * following[seq[tau]] * rest
    return out, block_tau, token_tau


def _target_joint(target: Table, seq: Prefix) -> float:
    return math.prod(float(target(seq[:k])[t]) for k, t in enumerate(seq))


@pytest.mark.parametrize("name", CASES)
def test_block_verification_output_is_exactly_the_target_distribution(name: str) -> None:
    """Emitted tokens continued by target sampling have the target's joint distribution over n + 1 tokens."""
    vocab, n, target, draft = _case(name)
    out, _, _ = _exact_output(vocab, n, target, draft)
    assert sum(out.values()) == pytest.approx(1.0, abs=1e-12)
    worst = max(abs(pr - _target_joint(target, seq)) for seq, pr in out.items())
    assert worst < 1e-12, f"{name}: output and target joint differ by {worst:.3g}"


@pytest.mark.parametrize("name", CASES)
def test_block_verification_accepts_at_least_as_many_as_token_wise(name: str) -> None:
    """E[tau] of block verification >= that of token-wise verification (strictly more on the dense random cases;
    equal on the sparse one, where every first draft's ratio p/q is 0 or above 1: accepted or rejected outright)."""
    vocab, n, target, draft = _case(name)
    _, block_tau, token_tau = _exact_output(vocab, n, target, draft)
    assert block_tau >= token_tau - 1e-12
    if name == "paper_example":
        assert block_tau == pytest.approx(11 / 9, abs=1e-12) and token_tau == pytest.approx(10 / 9, abs=1e-12)
    elif name == "draft_equals_target":
        assert block_tau == pytest.approx(n, abs=1e-12) and token_tau == pytest.approx(n, abs=1e-12)
    elif name != "sparse_target":
        assert block_tau > token_tau + 1e-3, f"{name}: block {block_tau:.4f}, token-wise {token_tau:.4f}"


def test_single_draft_is_token_wise_rejection_sampling() -> None:
    """n == 1: accept with min(1, p/q), else sample max(p - q, 0): the rule of `rejection_sample`."""
    _, _, target, draft = _case("prefix_dependent_draft")
    for token in range(3):
        target_rows, draft_rows, ids = _block(target, draft, (token,))
        weights, final = _block_verification(target_rows, draft_rows, ids)
        p, q = target_rows[0], draft_rows[0]
        assert weights.tolist() == pytest.approx([min(1.0, float(p[token] / q[token]))], abs=1e-15)
        assert torch.allclose(final[0], (p - q).clamp_min(0), atol=1e-15)
        assert torch.equal(final[1], target_rows[1])


@pytest.mark.parametrize("name", ["prefix_dependent_draft", "prefix_independent_draft", "sparse_target"])
def test_op_draws_n_uniforms_then_one_race_and_follows_the_weights(name: str) -> None:
    """With a replayed generator: tau = max {i : eta_i < h_i}, the token is the race over final[tau], and the
    generator ends where n uniforms and one [V] race leave it. Over the seeds every tau in 0..n occurs."""
    vocab, n, target, draft = _case(name)
    drafting = torch.Generator().manual_seed(99)
    seen_tau = set()
    for seed in range(150):
        drafts: Prefix = ()
        for _ in range(n):
            drafts += (int(torch.multinomial(draft(drafts), 1, generator=drafting)),)
        target_rows, draft_rows, ids = _block(target, draft, drafts)
        g = torch.Generator().manual_seed(seed)
        replay = torch.Generator().set_state(g.get_state())
        tau, token = block_rejection_sample(target_rows.float(), draft_rows.float(), ids, g)
        weights, final = _block_verification(target_rows.float(), draft_rows.float(), ids)
        eta = torch.rand(n, dtype=torch.float64, generator=replay)
        expected_tau = max([i + 1 for i in range(n) if eta[i] < weights[i]], default=0)
        expected_token = int(random_sample(final[expected_tau][None], [replay])[0])
        assert (tau, token) == (expected_tau, expected_token)
        assert torch.equal(g.get_state(), replay.get_state())
        assert float(final[tau][token]) > 0
        seen_tau.add(tau)
    assert seen_tau == set(range(n + 1))


def test_seeded_generator_reproduces_its_result() -> None:
    """The same seed gives the same (tau, token) whatever the default generator's state."""
    _, n, target, draft = _case("prefix_independent_draft")
    target_rows, draft_rows, ids = _block(target, draft, (1, 0, 2))
    results = []
    for default_seed in (0, 1):
        torch.manual_seed(default_seed)
        results.append([block_rejection_sample(target_rows, draft_rows, ids, torch.Generator().manual_seed(s))
                        for s in range(20)])
    assert results[0] == results[1]
    assert len(set(results[0])) > 1


def test_no_drafts_samples_the_first_target_row() -> None:
    """n == 0: (0, a token drawn from target_probs[0] by one exponential race)."""
    target = torch.tensor([[0.0, 0.3, 0.7]])
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        replay = torch.Generator().set_state(g.get_state())
        got = block_rejection_sample(target, torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), g)
        assert got == (0, int(random_sample(target.double(), [replay])[0])) and got[1] != 0


def test_zero_draft_probability_and_empty_residual_are_handled() -> None:
    """q(d) == 0 divides nothing: a draft the target allows passes (a = 1), one it excludes never does; a residual
    with no mass (q == p after full acceptance) falls back to the target row."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.6, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
    weights, final = _block_verification(p, q, torch.tensor([0, 1]))  # q(d_1) = 0 < p(d_1)
    assert torch.isfinite(weights).all() and torch.isfinite(final).all()
    assert weights[1] == 1.0  # a_1 = 1, then P_2 == Q_2: a_2 = 1
    assert torch.equal(final[1], p[1])  # max(P_2 - Q_2, 0) == 0: the fallback
    excluded = torch.tensor([2, 1])  # P_1(2) = 0 < Q_1(2): the target excludes d_1
    weights, _ = _block_verification(p, q, excluded)
    assert weights.tolist() == [0.0, 0.0]
    for seed in range(20):
        assert block_rejection_sample(p, q, excluded, torch.Generator().manual_seed(seed))[0] == 0
    both_zero = torch.tensor([[0.0, 1.0], [0.5, 0.5]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    weights, final = _block_verification(*both_zero)
    assert weights.tolist() == [0.0] and torch.isfinite(final).all()


@pytest.mark.parametrize("shapes", [((3, 4), (2, 5), (2,)), ((3, 4), (3, 4), (3,)), ((3, 4), (2, 4), (3,)),
                                    ((4,), (2, 4), (2,))], ids=["vocab", "rows", "ids", "target_1d"])
def test_shape_errors_raise_value_error(shapes) -> None:
    target, draft, ids = shapes
    with pytest.raises(ValueError, match="block_rejection_sample"):
        block_rejection_sample(torch.full(target, 0.25), torch.full(draft, 0.25), torch.zeros(ids, dtype=torch.long),
                               None)
