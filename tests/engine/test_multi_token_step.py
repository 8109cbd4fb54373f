"""The multi-token step on a real tiny model: a test proposer replays a recorded plain run, partly wrong on purpose;
every output equals plain decoding (greedy and seeded sampling), with prefix caching, chunked prefill and
preemption in the same run, and every block, running slot and scratch slot is free afterwards."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from deltaserve.cache.state_pool import SCRATCH
from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode import Proposal
from tests.helpers import prompt_ids

K = 4


class ReplayProposer:
    """Proposes the next tokens of a recorded run: sometimes all right, sometimes one wrong, sometimes nothing."""

    num_speculative_tokens = K
    memory_bytes = 0

    def __init__(self, recorded: dict[str, list[int]], seed: int) -> None:
        self.recorded, self.rng = recorded, random.Random(seed)
        self.proposed = 0

    def forget(self, request_id: str) -> None:
        pass

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            truth = self.recorded[r.request_id][len(r.output_token_ids):]
            n = self.rng.choice([0, 2, K, K + 3])  # more than K: the engine trims
            proposal = list(truth[:n])
            if proposal and self.rng.random() < 0.5:
                proposal[self.rng.randrange(len(proposal))] += 1  # wrong on purpose
            self.proposed += len(proposal)
            out[r.request_id] = Proposal(proposal)
        return out


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    multi = 0
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None
            outputs[out.request_id].extend(out.new_token_ids)
            multi += len(out.new_token_ids) > 1
    core.multi_token_outputs = multi  # type: ignore[attr-defined]
    return outputs


def config(path: str, **cache: object) -> EngineConfig:
    return EngineConfig(model=path, cache=CacheConfig(**cache),  # type: ignore[arg-type]
                        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))


@pytest.fixture(scope="module")
def path(tiny_dir):
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def requests():
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lengths = [3, 17, 40, 9, 33, 5]
    reqs = {}
    for i, n in enumerate(lengths):
        params = greedy if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=50, seed=7 + i, max_tokens=24,
                                                          ignore_eos=True, presence_penalty=0.3)
        reqs[f"r{i}"] = (prompt_ids(1024, n, seed=300 + i), params)
    shared = reqs["r2"][0][:32]  # a prefix hit for r6, once r2 has finished and cached its prefix
    reqs["r6"] = (shared + prompt_ids(1024, 6, seed=399), greedy)
    return reqs


@pytest.mark.parametrize("cache", [dict(), dict(num_blocks=6, num_state_slots=3)], ids=["roomy", "preempting"])
def test_proposals_give_plain_outputs_and_free_everything(path, requests, cache):
    plain = run(EngineCore(config(path, **cache)), requests)
    proposer = ReplayProposer(plain, seed=1)
    core = EngineCore(config(path, **cache), proposer=proposer)
    assert run(core, requests) == plain
    assert proposer.proposed > 0 and core.multi_token_outputs > 0  # type: ignore[attr-defined]
    if cache:
        assert core.scheduler.num_preemptions > 0
    usage = core.cache.usage()
    assert (usage.num_free_blocks, usage.num_free_slots) == (usage.num_blocks, usage.num_slots)
    assert core.cache.slots.num_free_of(SCRATCH) == core.cache.slots.num_scratch_slots == 8 * K
    assert core.cache.prefix_stats().hit_tokens > 0


def test_zero_proposals_after_an_accepted_step_commit_the_state(path, requests):
    """A step that proposes nothing right after one that accepted proposals must start from the committed state
    (vLLM #39273): alternate full and empty proposals on one greedy request."""
    prompt, params = requests["r0"]
    plain = run(EngineCore(config(path)), {"a": (prompt, params)})

    class Alternating(ReplayProposer):
        def propose(self, reqs: Sequence[Request]) -> dict[str, Proposal]:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls % 2 == 0:
                return {}
            return {r.request_id: Proposal(self.recorded[r.request_id][len(r.output_token_ids):][:K]) for r in reqs}

    core = EngineCore(config(path), proposer=Alternating(plain, seed=0))
    assert run(core, {"a": (prompt, params)}) == plain
    assert core.multi_token_outputs > 0  # type: ignore[attr-defined]
