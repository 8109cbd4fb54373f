"""Sampling with speculation draws the first tokens from the same distribution as sampling without it (issue 17).

NUM_SEEDS seeded requests share one prompt (temperature 0.5, top-k 4: each position has a small support) and run
through the real `EngineCore` twice: plainly, and with a proposer that draws k = 2 drafts per step from a fixed
distribution q that is not the target and hands q over as `Proposal.probs`, so the sampler verifies them by
rejection sampling. q puts a fifth of its mass on tokens outside every top-k (always rejected: the residual
max(p - q, 0) must make up for them) and the rest on the plain run's tokens in the opposite order of frequency; once
context-free (few acceptances) and once per context (p's support: runs of accepted drafts and bonus tokens). The two
runs use disjoint seeds, so their samples are independent; the histograms of tokens 1 to 4 and the joints of
(1, 2) and (2, 3) must each pass a chi-square two-sample test at significance ALPHA = 0.001. Token 1 comes from the
prefill step, before any proposal (a control); tokens 2 and 3 are verified drafts, residual samples or bonus tokens.
Every seed is fixed, so the outcome is the same on every run (measured p-values: 0.10 to 0.77).

Power, measured by patching the code under test: sampling p instead of the residual after a rejection fails the
conditional case (token 2: p = 2e-24; the context-free one, with few acceptances, only reaches p = 0.008), as do the
draft distribution of the wrong position (token 3: p = 4e-61) and accepting with min(1, q/p) (both cases, p < 1e-180);
accepting every draft fails the rejection check.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import pytest
import torch

from deltaserve.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.models.dspark import DSparkConfig, DSparkDrafter
from deltaserve.models.loader import load_model
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode import Proposal
from deltaserve.spec_decode.dspark_training import fit, sequence_features
from deltaserve.spec_decode.metrics import SpecDecodeStats
from tests.helpers import prompt_ids

ALPHA = 1e-3
"""A histogram pair fails when the chi-square two-sample p-value is below this."""
MIN_BIN = 10
"""Categories with fewer samples (both runs together) are pooled into one bin, so expected counts stay >= 5."""
OUTSIDE_MASS = 0.2
"""The share of q on tokens the plain run never produced at that position."""
NUM_OUTSIDE = 4
TOP_K = 4
TEMPERATURE = 0.5
"""At 1.0 the tiny model's top-4 is nearly flat (p ~ .34/.27/.23/.16 for token 1): a verifier that samples p instead
of max(p - q, 0) after a rejection then moves the histograms too little for NUM_SEEDS to see. At 0.5 it fails."""
Q_EXPONENT = -0.5
"""q favours the tokens the plain run produced least: deliberately unlike p."""
MAX_TOKENS = 4
"""Tokens per request: a step proposes at most max_tokens - 1 - (tokens so far) (room for the bonus token), so
with k = 2 tokens 2 and 3 are verified drafts (or residual samples)."""
NUM_SEEDS = 2048
"""Requests per run (the slow variant: 8x)."""
MAX_NUM_SEQS = 256
PROMPT_LEN = 17
"""One full KV block (16) and one token."""


class SampledDraftProposer:
    """Proposes k tokens, each drawn from `draft(output so far + the drafts before it)`, a fixed function of the
    context (a draft model that is not the target), with those distributions as `probs`."""

    memory_bytes = 0

    def __init__(self, draft: Callable[[tuple[int, ...]], torch.Tensor], k: int, seed: int) -> None:
        self.draft, self.num_speculative_tokens = draft, k
        self.generator = torch.Generator().manual_seed(seed)

    def forget(self, request_id: str) -> None:
        pass

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            context, rows = tuple(r.output_token_ids), []
            for _ in range(self.num_speculative_tokens):
                rows.append(self.draft(context))
                context += (int(torch.multinomial(rows[-1], 1, generator=self.generator)),)
            out[r.request_id] = Proposal(list(context[len(r.output_token_ids):]), torch.stack(rows))
        return out


def run(core: EngineCore, prompt: list[int], seeds: range, max_tokens: int) -> list[list[int]]:
    """The `max_tokens` tokens of one request per seed, in seed order. One request runs first, alone, so that the
    others find the prompt's first block and its state checkpoint in the prefix cache: their one-token remainder is
    a decode row (a chunked KDA prefill costs as much for 17 tokens as for 64)."""
    outputs: dict[str, list[int]] = {}
    for batch in (seeds[:1], seeds[1:]):
        for seed in batch:
            params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed, max_tokens=max_tokens,
                                    ignore_eos=True)
            core.add_request(f"s{seed}", prompt, params)
            outputs[f"s{seed}"] = []
        while core.has_unfinished_requests():
            for out in core.step():
                assert out.error is None
                outputs[out.request_id].extend(out.new_token_ids)
    assert all(len(t) == max_tokens for t in outputs.values())
    return [outputs[f"s{seed}"] for seed in seeds]


def make_draft(plain: list[list[int]], vocab: int, conditional: bool) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """q(context): 1 - OUTSIDE_MASS over the tokens the plain run produced at that output position (after the same
    context, if `conditional` and the plain run saw it; else after any), in proportion to count ** Q_EXPONENT, and
    OUTSIDE_MASS evenly over NUM_OUTSIDE tokens the plain run never produced (outside every top-k: always rejected).
    Context-free q spreads over every context's tokens (few acceptances); conditional q has p's support (runs of
    accepted drafts and bonus tokens) but the opposite shape."""
    produced, max_tokens = {t for tokens in plain for t in tokens}, len(plain[0])
    outside = [t for t in range(vocab) if t not in produced][:NUM_OUTSIDE]

    def from_tokens(tokens: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        counts = torch.where(counts > 0, counts ** Q_EXPONENT, 0.0)
        q = (1 - OUTSIDE_MASS) * counts / counts.sum()
        q[outside] = OUTSIDE_MASS / len(outside)
        return q.float()

    marginal = [from_tokens([t[j] for t in plain]) for j in range(max_tokens)]
    after: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
    for t in plain:
        for j in range(max_tokens):
            after[tuple(t[:j])].append(t[j])
    following = {context: from_tokens(tokens) for context, tokens in after.items()}

    def draft(context: tuple[int, ...]) -> torch.Tensor:
        if conditional and context in following:
            return following[context]
        return marginal[min(len(context), max_tokens - 1)]

    return draft


def chi_square_two_sample(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of the chi-square test that samples `a` and `b` come from one
    categorical distribution. Categories with fewer than MIN_BIN samples in all are pooled (the pool joins the
    smallest category if it is still below MIN_BIN). p = Q(df / 2, stat / 2), the regularised upper gamma."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    big = [k for k in keys if ca[k] + cb[k] >= MIN_BIN]
    pool = [k for k in keys if ca[k] + cb[k] < MIN_BIN]
    rows = [[ca[k], cb[k]] for k in big]
    pooled = [sum(ca[k] for k in pool), sum(cb[k] for k in pool)]
    if sum(pooled) >= MIN_BIN or not rows:
        rows.append(pooled)
    elif sum(pooled):
        rows[-1] = [rows[-1][0] + pooled[0], rows[-1][1] + pooled[1]]
    table = torch.tensor(rows, dtype=torch.float64)  # [C, 2]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = len(rows) - 1
    if df == 0:
        return stat, df, 1.0
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, df, p


PROJECTIONS: dict[str, Callable[[list[int]], Hashable]] = {
    "token 1": lambda t: t[0],
    "token 2": lambda t: t[1],
    "token 3": lambda t: t[2],
    "token 4": lambda t: t[3],
    "tokens 1, 2": lambda t: (t[0], t[1]),
    "tokens 2, 3": lambda t: (t[1], t[2]),
}


def engine_config(path: str) -> EngineConfig:
    return EngineConfig(model=path, scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=MAX_NUM_SEQS))


def prompt() -> list[int]:
    return prompt_ids(1024, PROMPT_LEN, seed=5)


def plain_run(path: str, num_seeds: int, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Seeds 0..num_seeds-1 without speculation."""
    core = EngineCore(engine_config(path))
    try:
        return run(core, prompt(), range(num_seeds), max_tokens)
    finally:
        core.shutdown()


def check_same_distribution(path: str, plain: list[list[int]], k: int, conditional: bool) -> None:
    """Seeds 100000.. with a sampled-draft proposer of k tokens against `plain`, token histogram by histogram."""
    vocab = ModelConfig.from_pretrained(path).vocab_size
    core = EngineCore(engine_config(path), proposer=SampledDraftProposer(make_draft(plain, vocab, conditional), k,
                                                                         seed=11))
    compare_run(core, plain, k)


def compare_run(core: EngineCore, plain: list[list[int]], k: int) -> None:
    """Seeds 100000.. through `core` (shut down after), compared with `plain` (`compare`)."""
    try:
        spec = run(core, prompt(), range(100_000, 100_000 + len(plain)), len(plain[0]))
    finally:
        core.shutdown()
    assert core.proposer_hook is not None
    compare(plain, spec, core.proposer_hook.stats, k)


def compare(plain: list[list[int]], spec: list[list[int]], stats: SpecDecodeStats, k: int) -> None:
    """The speculative run verified drafts of every kind (accepted, rejected, runs of two, k at once), and its
    histograms match the plain run's."""
    assert stats.num_drafts > 0
    first_rejected = stats.num_drafts - stats.accepted_per_pos[0]
    assert stats.num_accepted_tokens > 0, "no proposal was ever accepted"
    assert first_rejected > 0, "no proposal was ever rejected: the residual path never ran"
    assert stats.accepted_per_pos[1:2] and stats.accepted_per_pos[1] > 0, "no run of two accepted drafts"
    assert len(stats.accepted_per_pos) == k, f"no step verified {k} drafts"
    results = {name: chi_square_two_sample([f(t) for t in plain], [f(t) for t in spec])
               for name, f in PROJECTIONS.items()}
    report = "; ".join(f"{name}: chi2={s:.1f} df={df} p={p:.3g}" for name, (s, df, p) in results.items())
    print(f"{stats}; {report}")  # shown with -s: the measured acceptance and p-values
    failed = [name for name, (_, _, p) in results.items() if p < ALPHA]
    assert not failed, f"spec and plain sampling differ at {failed} (alpha={ALPHA}): {report}"
    assert all(df >= 3 for _, df, _ in results.values()), f"histograms too coarse to mean anything: {report}"


def fit_drafter(path: str, plain: list[list[int]], out: Path, k: int) -> str:
    """A block drafter for `path` fitted (a few seconds) to the first 512 plain samples, so that its drafts, drawn
    at the requests' temperature and top-k, are often but not always accepted."""
    torch.manual_seed(0)
    target = load_model(path)
    cfg = ModelConfig.from_pretrained(path)
    dcfg = DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tap_layers=(1, 7), num_layers=1,
                        intermediate_size=128, block_size=k, context_window=4)
    seqs = sequence_features(target, [(prompt() + t, PROMPT_LEN) for t in plain[:512]], dcfg.tap_layers,
                             dcfg.context_window)
    drafter = DSparkDrafter(dcfg).init_for_training()
    fit(drafter, seqs, target.embed_tokens.float(), target.lm_head.float(), 60)
    drafter.save(out)
    return str(out)


@pytest.fixture(scope="module")
def path(tiny_dir) -> str:
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def plain(path, one_thread) -> list[list[int]]:
    return plain_run(path, NUM_SEEDS)


@pytest.mark.parametrize("conditional", [False, pytest.param(True, marks=pytest.mark.slow)],  # CI time
                         ids=["context_free_q", "conditional_q"])
def test_speculation_keeps_the_distribution_of_the_first_tokens(path, plain, one_thread, conditional):
    check_same_distribution(path, plain, k=2, conditional=conditional)


@pytest.mark.slow
@pytest.mark.parametrize("conditional", [False, True], ids=["context_free_q", "conditional_q"])
def test_speculation_keeps_the_distribution_of_the_first_tokens_large(path, one_thread, conditional):
    """8x the seeds, k = 3 and one more token, so that tokens 2, 3 and 4 can all be verified drafts."""
    check_same_distribution(path, plain_run(path, 8 * NUM_SEEDS, MAX_TOKENS + 1), k=3, conditional=conditional)


@pytest.mark.parametrize("rejection", ["block", pytest.param("standard", marks=pytest.mark.slow)])  # CI time
def test_block_drafter_keeps_the_distribution_of_the_first_tokens(path, plain, one_thread, tmp_path, rejection):
    """Method dspark with probabilistic drafts (every block row drawn from the drafter's q at the request's
    temperature and top-k, its q kept on the worker) and block verification (or the per-token rule)."""
    k = MAX_TOKENS - 2  # drafts start after the prefill's token; each step keeps room for its sampled token
    drafter = fit_drafter(path, plain, tmp_path / "drafter", k)
    config = dataclasses.replace(engine_config(path), speculative_config=SpeculativeConfig(
        method="dspark", num_speculative_tokens=k, model=drafter, rejection_sample_method=rejection,
        enable_adaptive_verification=False))
    compare_run(EngineCore(config), plain, k)
