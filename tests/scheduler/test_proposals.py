"""The multi-token step contract at the scheduler: proposed tokens verified in a step, the rejected ones rolled back.

The fake runner verifies proposals the way the model runner does (accept while its sampled token equals them), so
outputs must equal plain decoding whatever the proposer says; scratch slots, running slots and blocks must balance.
"""

from __future__ import annotations

import random

import pytest

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.state_pool import SCRATCH
from deltaserve.config import SchedulerConfig
from deltaserve.request import Request
from deltaserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake import FakeRunner, expected_output, make_request

K = 3


def propose(sched: Scheduler, rng: random.Random) -> None:
    """Propose the true continuation with some tokens wrong on purpose, sometimes nothing, sometimes too many."""
    for r in sched.running:
        if r.num_tokens - r.num_computed_tokens != 1:
            continue
        truth = expected_output(r)[len(r.output_token_ids):]
        n = rng.choice([0, 1, K, K + 2])
        proposal = truth[:n] + [7] * (n - len(truth[:n]))
        if proposal and rng.random() < 0.4:
            proposal[rng.randrange(len(proposal))] = (proposal[0] + 1) % 97  # a wrong token
        r.spec_token_ids = proposal


def run(sched: Scheduler, runner: FakeRunner, rng: random.Random) -> tuple[dict[str, list[int]], int]:
    outputs: dict[str, list[int]] = {}
    multi = 0
    for _ in range(10_000):
        if not sched.has_unfinished():
            return outputs, multi
        propose(sched, rng)
        out = sched.schedule()
        for c in out.chunks:
            assert not c.num_proposed or c.new_token_ids[1:] == sched.requests[c.request_id].spec_token_ids[
                :c.num_proposed]
        for ev in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ev.request.request_id, []).extend(t.token_id for t in ev.tokens)
            multi += len(ev.tokens) > 1
    raise AssertionError("not finished")


def make(num_blocks: int, num_slots: int, budget: int) -> Scheduler:
    cache = CacheManager(num_blocks=num_blocks, num_slots=num_slots, block_size=4, num_scratch_slots=num_slots * K)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), cache)


def requests(n: int, stop: frozenset[int] = frozenset()) -> list[Request]:
    return [make_request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=9 + 3 * i, seed=i, stop=stop) for i in range(n)]


def test_proposals_keep_outputs_and_balance_the_pools():
    sched, runner = make(num_blocks=64, num_slots=8, budget=64), FakeRunner()
    reqs = requests(6)
    for r in reqs:
        sched.add_request(r)
    outputs, multi = run(sched, runner, random.Random(0))
    assert multi > 0, "no step accepted a proposal: the test exercises nothing"
    assert outputs == {r.request_id: expected_output(r) for r in reqs}
    usage = sched.cache.usage()
    assert (usage.num_free_blocks, usage.num_free_slots) == (64, 8)
    assert sched.cache.slots.num_free_of(SCRATCH) == 8 * K


def test_proposals_under_preemption_chunking_and_stop_tokens():
    """A tight cache (preemption), a small budget (chunked prefill, trimmed proposals) and stop tokens inside
    accepted proposals."""
    sched, runner = make(num_blocks=16, num_slots=4, budget=6), FakeRunner()
    stop = frozenset({5, 11, 23})
    reqs = requests(6, stop)
    for r in reqs:
        sched.add_request(r)
    outputs, multi = run(sched, runner, random.Random(1))
    assert multi > 0
    assert sched.num_preemptions > 0
    assert outputs == {r.request_id: expected_output(r) for r in reqs}
    usage = sched.cache.usage()
    assert (usage.num_free_blocks, usage.num_free_slots) == (16, 4)
    assert sched.cache.slots.num_free_of(SCRATCH) == 4 * K


def test_rejected_proposal_rolls_the_state_slot_back():
    """The state after the accepted tokens lives in the scratch slot that received it: the request's running slot
    becomes that slot, and every other scratch slot is released."""
    sched, runner = make(num_blocks=16, num_slots=2, budget=64), FakeRunner()
    req = make_request("a", prompt_len=5, max_tokens=10)
    sched.add_request(req)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))  # prefill + first token
    truth = expected_output(req)
    req.spec_token_ids = [truth[1], truth[2] + 1, truth[3]]  # the second proposal is wrong
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.num_proposed == 3 and [p for p, _ in chunk.checkpoints] == [1, 2, 3]
    scratch = [s for _, s in chunk.checkpoints]
    (event,) = sched.update_from_output(out, runner.execute(out))
    assert [t.token_id for t in event.tokens] == truth[1:3]  # one accepted proposal + the sampled token
    assert req.num_computed_tokens == 5 + 2  # prompt, first token, the accepted proposal
    assert sched.cache.slot("a") == scratch[1]  # the state after 2 of the step's tokens
    assert sched.cache.slots.num_free_of(SCRATCH) == 2 * K


@pytest.mark.parametrize("num_blocks", [4, 5])
def test_proposals_never_preempt_and_rejected_blocks_are_released(num_blocks):
    """Proposals take only blocks left once every running request has its own: two requests of 4 + 1 tokens hold
    2 blocks of 4 each, so with 4 blocks wrong proposals for `a` get none (and `b` is not preempted), with 5 they get
    the free one; after their rejection `a` holds only the blocks of its computed tokens."""
    sched, runner = make(num_blocks=num_blocks, num_slots=2, budget=64), FakeRunner()
    a, b = make_request("a", prompt_len=4, max_tokens=8, seed=1), make_request("b", prompt_len=4, max_tokens=8, seed=2)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))  # both prefills + first tokens
    a.spec_token_ids = [1999, 1998, 1997, 1996]  # wrong: outside the fake model's vocabulary
    out = sched.schedule()
    assert sched.num_preemptions == 0 and {c.request_id for c in out.chunks} == {"a", "b"}
    (chunk,) = [c for c in out.chunks if c.request_id == "a"]
    assert chunk.num_proposed == (0 if num_blocks == 4 else 4)
    sched.update_from_output(out, runner.execute(out))
    assert len(sched.cache.block_ids("a")) == sched.cache.blocks_for(a.num_computed_tokens)
    run(sched, runner, random.Random(3))
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)
    assert sched.cache.usage().num_free_blocks == num_blocks
