"""Greedy decoding with speculation gives exactly the output of greedy decoding without it (issue 17).

Every run mixes prompt lengths, chunked prefill (a 24-token budget), a prefix-cache hit (a request sharing 32
tokens with an earlier one) and forced preemption (6 blocks, 3 state slots), and ends with every block, running
slot and scratch slot free. Proposers: a replay of the plain run (right, corrupted, cut, empty, too long), the n-gram
lookup and a draft model; k in {1, 3, 7}.

Verify rows run the decode ops token by token (KDA recurrent decode, conv decode, MLA absorbed decode), so the
only math that differs from a plain decode step is the dense GEMMs (linear layers, experts, LM head): CPU BLAS
results for a row depend on the number of rows in the call (~1e-5 in fp32, ~5e-14 in fp64). fp32 runs are checked
for greedy equality (measured: logprobs differ by up to 1.7e-5); fp64 runs (no op rounds to fp32 there, except the
logits handed to the sampler) for greedy equality and for logprobs equal to within 1e-9 (measured: 0.0, bit-identical,
on the base and K3 checkpoints: the fp64 differences vanish when the logits are rounded to fp32).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from deltaserve.cache.state_pool import SCRATCH
from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode import Proposal, Proposer
from tests.helpers import prompt_ids

MAX_TOKENS = 16
PREEMPTING = dict(num_blocks=5, num_state_slots=3, num_checkpoint_slots=8)
"""Small enough that the batch preempts requests, large enough that the shared prefix is still cached."""
LOGPROB_TOL = 1e-9
"""fp64: a verified token's logprob against the plain decode's (the issue's bound; measured 0.0)."""


@dataclass
class Run:
    """What a run returned, by request id."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    multi_token_outputs: int = 0
    """Outputs with more than one token: steps where proposals were accepted."""


def requests(path: str) -> dict[str, tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths (the 40 and 33 token ones are prefilled in chunks); r6 shares the first 32 tokens of r5,
    the last request added (so usually the last to finish), and is added when r5 finishes (`LATE`): its prefix is
    then still cached, a hit, even in a cache so small that requests are preempted."""
    vocab = ModelConfig.from_pretrained(path).vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    reqs = {f"r{i}": (prompt_ids(vocab, n, seed=300 + i), params) for i, n in enumerate([3, 17, 9, 33, 5, 40])}
    reqs["r6"] = (reqs["r5"][0][:32] + prompt_ids(vocab, 6, seed=399), params)
    return reqs


LATE = {"r5": "r6"}
"""A request that finishes -> the request added then."""


def engine_config(path: str, dtype: str = "float32") -> EngineConfig:
    return EngineConfig(model=path, dtype=dtype, cache=CacheConfig(**PREEMPTING),  # type: ignore[arg-type]
                        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))


def run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]],
        abort_after: dict[str, int] | None = None) -> Run:
    """Step `core` until every request is done. `abort_after`: request id -> abort it after that many steps."""
    for rid, (prompt, params) in reqs.items():
        if rid not in LATE.values():
            core.add_request(rid, prompt, params)
    result = Run({rid: [] for rid in reqs}, {rid: [] for rid in reqs})
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None
            if out.finish_reason is not None and out.request_id in LATE:
                core.add_request(LATE[out.request_id], *reqs[LATE[out.request_id]])
            result.tokens[out.request_id].extend(out.new_token_ids)
            result.logprobs[out.request_id].extend(lp.logprob for lp in out.logprobs if lp is not None)
            result.multi_token_outputs += len(out.new_token_ids) > 1
        steps += 1
        for rid, after in (abort_after or {}).items():
            if steps == after:
                core.abort_request(rid)
    return result


def assert_all_free(core: EngineCore) -> None:
    """Every block and slot (running, checkpoint-free and scratch) is back in its pool."""
    usage = core.cache.usage()
    assert (usage.num_free_blocks, usage.num_free_slots) == (usage.num_blocks, usage.num_slots)
    assert core.cache.slots.num_free_of(SCRATCH) == core.cache.slots.num_scratch_slots > 0


def assert_features_hit(core: EngineCore) -> None:
    """The run had what it is meant to cover: preemptions and prefix-cache hits."""
    assert core.scheduler.num_preemptions > 0
    assert core.cache.prefix_stats().hit_tokens > 0


class ReplayProposer:
    """Proposes the recorded plain run's next tokens: random lengths (0 included, some past k: the engine trims),
    half of them corrupted at a random position."""

    memory_bytes = 0

    def __init__(self, recorded: dict[str, list[int]], k: int, seed: int) -> None:
        self.recorded, self.num_speculative_tokens, self.rng = recorded, k, random.Random(seed)
        self.proposed = 0

    def forget(self, request_id: str) -> None:
        pass

    def propose(self, reqs: Sequence[Request]) -> dict[str, Proposal]:
        out = {}
        for r in reqs:
            truth = self.recorded[r.request_id][len(r.output_token_ids):]
            n = self.rng.randint(0, self.num_speculative_tokens + 2)
            proposal = list(truth[:n])
            if proposal and self.rng.random() < 0.5:
                i = self.rng.randrange(len(proposal))
                proposal[i] = (proposal[i] + 1) % 700  # wrong on purpose (700: the smallest vocabulary)
            self.proposed += len(proposal)
            out[r.request_id] = Proposal(proposal)
        return out


class Counting:
    """Delegates to a real proposer and counts the tokens it proposed (to check that the run speculated)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.proposed = inner, 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    @property
    def memory_bytes(self) -> int:
        return self.inner.memory_bytes

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def propose(self, reqs: Sequence[Request]) -> dict[str, Proposal]:
        out = self.inner.propose(reqs)
        self.proposed += sum(len(p.token_ids) for p in out.values())
        return out


_PLAIN: dict[tuple[str, str], Run] = {}


def plain_run(path: str, dtype: str) -> Run:
    """The run without speculation (once per checkpoint and dtype)."""
    if (path, dtype) not in _PLAIN:
        core = EngineCore(engine_config(path, dtype))
        _PLAIN[path, dtype] = run(core, requests(path))
        assert_features_hit(core)
    return _PLAIN[path, dtype]


def check_speculative_run(path: str, dtype: str, proposer: Proposer) -> Run:
    """A speculative run of the batch equals the plain run; everything is freed; the run speculated."""
    plain = plain_run(path, dtype)
    counting = Counting(proposer)
    core = EngineCore(engine_config(path, dtype), proposer=counting)
    spec = run(core, requests(path))
    assert spec.tokens == plain.tokens
    if dtype == "float64":
        diffs = [abs(a - b) for rid in plain.logprobs for a, b in zip(spec.logprobs[rid], plain.logprobs[rid],
                                                                       strict=True)]
        assert len(diffs) == len(plain.logprobs) * MAX_TOKENS and max(diffs) <= LOGPROB_TOL
    assert counting.proposed > 0
    assert_features_hit(core)
    assert_all_free(core)
    return spec


@pytest.fixture(scope="module")
def base(tiny_dir) -> str:
    return str(tiny_dir("base"))


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, 7])  # CI time
def test_replay_proposals_give_plain_greedy_output(base, k):
    plain = plain_run(base, "float32")
    spec = check_speculative_run(base, "float32", ReplayProposer(plain.tokens, k, seed=k))
    assert spec.multi_token_outputs > 0


@pytest.mark.parametrize("variant", ["base", pytest.param("k3", marks=pytest.mark.slow)])
def test_fp64_verify_rows_equal_decode_rows(tiny_dir, variant):
    """fp64: tokens identical and every logprob within 1e-9 of the plain run's (the dense GEMMs' row-count
    dependence is the only difference left, ~1e-16 relative, and the logits are rounded to fp32 for the sampler)."""
    path = str(tiny_dir(variant))
    plain = plain_run(path, "float64")
    spec = check_speculative_run(path, "float64", ReplayProposer(plain.tokens, 3, seed=11))
    assert spec.multi_token_outputs > 0


def ngram(k: int) -> Proposer:
    from deltaserve.spec_decode.ngram import NgramProposer

    return NgramProposer(k, 1, 4)


def draft(k: int, target: str, draft_path: str, dtype: str = "float32") -> Proposer:
    from deltaserve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(model=draft_path, num_speculative_tokens=k, draft_sample_method="greedy",
                              engine=engine_config(target, dtype))


def test_ngram_proposals_give_plain_greedy_output(base):
    check_speculative_run(base, "float32", ngram(3))


def test_k3_replay_proposals_give_plain_greedy_output(tiny_dir):
    path = str(tiny_dir("k3"))
    plain = plain_run(path, "float32")
    spec = check_speculative_run(path, "float32", ReplayProposer(plain.tokens, 3, seed=2))
    assert spec.multi_token_outputs > 0


@pytest.mark.slow  # CI time: test_draft_model.py's draft-equals-target and different-draft tests cover this
def test_draft_model_proposals_give_plain_greedy_output(base):
    """The target as its own draft: its drafts are (nearly) always accepted, so most steps verify k tokens."""
    spec = check_speculative_run(base, "float32", draft(3, base, base))
    assert spec.multi_token_outputs > 0


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 7])
@pytest.mark.parametrize("method", ["ngram", "draft", "other-draft"])
def test_other_proposers_and_k_give_plain_greedy_output(tiny_dir, base, method, k):
    if method == "ngram":
        check_speculative_run(base, "float32", ngram(k))
    else:  # a draft that is the target, or another model of the same vocabulary (few drafts accepted)
        check_speculative_run(base, "float32", draft(k, base, base if method == "draft" else
                                                     str(tiny_dir("no-dense-4groups"))))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", ["qlora-2shared-bsmoe", "odd-sizes", "no-dense-4groups", "k3", "k3-gpt-oss",
                                     "k3-odd"])
def test_every_parity_checkpoint(tiny_dir, variant, dtype):
    """Every transformers parity checkpoint, replay and n-gram (draft model: the checkpoint itself)."""
    path = str(tiny_dir(variant))
    plain = plain_run(path, dtype)
    check_speculative_run(path, dtype, ReplayProposer(plain.tokens, 3, seed=5))
    check_speculative_run(path, dtype, ngram(3))
    check_speculative_run(path, dtype, draft(3, path, path, dtype))


class Bursty(ReplayProposer):
    """Correct drafts, but per request a fixed pattern of steps with none and steps with many (past k: trimmed):
    a step after an accepted run that proposes nothing must start from the committed state (vLLM #39273)."""

    PATTERN = (0, 0, 9, 0, 9, 9, 1, 0)

    def __init__(self, recorded: dict[str, list[int]], k: int) -> None:
        super().__init__(recorded, k, seed=0)
        self.calls: dict[str, int] = {}

    def propose(self, reqs: Sequence[Request]) -> dict[str, Proposal]:
        out = {}
        for r in reqs:
            call = self.calls[r.request_id] = self.calls.get(r.request_id, -1) + 1
            n = self.PATTERN[(call + int(r.request_id[1:])) % len(self.PATTERN)]
            proposal = self.recorded[r.request_id][len(r.output_token_ids):][:n]
            self.proposed += len(proposal)
            out[r.request_id] = Proposal(proposal)
        return out


def test_zero_drafts_in_some_steps_and_many_in_others(base):
    plain = plain_run(base, "float32")
    spec = check_speculative_run(base, "float32", Bursty(plain.tokens, k=5))
    assert spec.multi_token_outputs > 0


@pytest.mark.parametrize("method", ["replay", pytest.param("draft", marks=pytest.mark.slow)])
def test_aborts_during_speculation_leak_nothing(base, method):
    """Requests aborted mid-run (running, preempted or waiting) free everything; the others are unchanged."""
    plain = plain_run(base, "float32")
    proposer = ReplayProposer(plain.tokens, 7, seed=3) if method == "replay" else draft(7, base, base)
    counting = Counting(proposer)
    core = EngineCore(engine_config(base), proposer=counting)
    aborted = {"r0": 3, "r1": 5, "r3": 9, "r4": 1}
    spec = run(core, requests(base), abort_after=aborted)
    for rid, tokens in spec.tokens.items():
        if rid in aborted:
            assert tokens == plain.tokens[rid][:len(tokens)]
        else:
            assert tokens == plain.tokens[rid]
    assert counting.proposed > 0
    assert_all_free(core)
    if method == "draft":  # the draft's own blocks and slots too
        usage = proposer.cache.usage()  # type: ignore[attr-defined]
        assert (usage.num_free_blocks, usage.num_free_slots) == (usage.num_blocks, usage.num_slots)
