"""Scheduler and cache-manager behaviour with a model-free runner: budgets, admission, preemption, no wedge."""

from __future__ import annotations

import logging

import pytest

from deltaserve.request import FinishReason, RequestStatus
from deltaserve.scheduler.output import ScheduledChunk
from tests.scheduler.fake import FakeRunner, expected_output, make_request, make_scheduler, run_to_completion


def assert_all_free(sched):
    usage = sched.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_outputs_follow_the_sequence_function():
    """With ample memory every request produces exactly its expected tokens and everything is freed."""
    sched, runner = make_scheduler(), FakeRunner()
    reqs = [make_request(f"r{i}", 3 + 5 * i, 6, seed=i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, runner)
    assert all(outputs[r.request_id] == expected_output(r) for r in reqs)
    assert_all_free(sched)


def test_token_budget_and_chunking():
    """No step exceeds max_num_batched_tokens; a long prompt is split into chunks and only its last one samples."""
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("long", 35, 2))
    out = sched.schedule()
    assert out.num_tokens == 10 and not out.chunks[0].sample and out.chunks[0].reset_state
    runner = FakeRunner()
    sched.update_from_output(out, runner.execute(out))
    sizes = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= 10
        sizes.append([len(c.new_token_ids) for c in out.chunks])
        sched.update_from_output(out, runner.execute(out))
    assert sizes[:3] == [[10], [10], [5]] and sizes[3] == [1]


def test_decodes_are_scheduled_before_prefill_chunks():
    """A running long prefill never takes the budget from running decodes (mixed batches)."""
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    sched.add_request(make_request("short", 3, 20))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("long", 100, 2))
    for _ in range(5):
        out = sched.schedule()
        by_id = {c.request_id: len(c.new_token_ids) for c in out.chunks}
        assert by_id["short"] == 1 and by_id.get("long", 0) == 7
        sched.update_from_output(out, runner.execute(out))


def test_admission_is_all_or_nothing_on_slots_and_blocks():
    """A waiting request is admitted only when both a state slot and its blocks are free; FCFS order is kept."""
    sched = make_scheduler(num_slots=2, num_blocks=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 3))
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]  # no slot for r2
    sched2 = make_scheduler(num_slots=4, num_blocks=5, block_size=4)
    sched2.add_request(make_request("a", 12, 1))  # 3 blocks
    sched2.add_request(make_request("b", 12, 1))  # needs 3, only 2 left
    sched2.add_request(make_request("c", 4, 1))  # would fit, but may not overtake b
    out = sched2.schedule()
    assert [c.request_id for c in out.chunks] == ["a"]
    assert sched2.cache.usage().num_free_slots == 3 and sched2.cache.usage().num_free_blocks == 2


def test_priority_policy_orders_admission_and_victims():
    """Under 'priority' a lower value is admitted first and the highest value is preempted first."""
    sched = make_scheduler(policy="priority", num_slots=1)
    sched.add_request(make_request("low", 4, 2, priority=5))
    sched.add_request(make_request("high", 4, 2, priority=1))
    assert [c.request_id for c in sched.schedule().chunks] == ["high"]


def test_heavy_preemption_keeps_outputs_and_frees_everything():
    """With a cache far too small, requests are preempted many times yet all finish with the expected tokens."""
    sched, runner = make_scheduler(num_blocks=12, num_slots=4, block_size=4, max_num_batched_tokens=16), FakeRunner()
    reqs = [make_request(f"r{i}", 5 + 3 * i, 20, seed=i) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, runner)
    assert sched.num_preemptions >= 5, sched.num_preemptions
    assert all(outputs[r.request_id] == expected_output(r) for r in reqs)
    assert_all_free(sched)


def test_no_wedge_at_full_occupancy():
    """Many long requests against a cache that holds a few: all complete within a bound on steps."""
    sched, runner = make_scheduler(num_blocks=40, num_slots=16, block_size=4, max_num_batched_tokens=64), FakeRunner()
    reqs = [make_request(f"r{i}", 60, 40, seed=i) for i in range(24)]  # each needs 25 of the 40 blocks at the end
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, runner, max_steps=24 * 200)
    assert sched.num_preemptions > 0, "the cache was meant to be too small"
    assert all(outputs[r.request_id] == expected_output(r) for r in reqs)
    assert runner.steps < 24 * 200
    assert_all_free(sched)


def test_stop_token_and_min_tokens():
    """A stop token ends a request (kept in its output) unless fewer than min_tokens exist."""
    sched, runner = make_scheduler(), FakeRunner()
    probe = make_request("probe", 5, 8)
    tokens = expected_output(probe)
    stop = tokens[2]
    r = make_request("r", 5, 8, stop={stop})
    sched.add_request(r)
    out = run_to_completion(sched, runner)
    assert out["r"] == tokens[: tokens.index(stop) + 1] and r.finish_reason is FinishReason.STOP


def test_abort_anytime_frees_everything():
    """Aborting waiting, running and mid-prefill requests returns every block and slot."""
    sched, runner = make_scheduler(num_slots=2, max_num_batched_tokens=8), FakeRunner()
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 20, 5))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.finish_request("r0", FinishReason.ABORT).status is RequestStatus.FINISHED  # mid-prefill
    assert sched.finish_request("r3", FinishReason.ABORT) is not None  # waiting
    assert sched.finish_request("nope", FinishReason.ABORT) is None
    out = sched.schedule()
    assert out.finished_request_ids == ["r0"]  # the runner is told about r0; r3 never reached it
    sched.update_from_output(out, runner.execute(out))
    run_to_completion(sched, runner)
    assert_all_free(sched)


def test_request_that_can_never_fit_is_rejected():
    """A request whose prompt + max_tokens exceeds the whole cache is refused with ValueError, not queued."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="raise cache_memory"):
        sched.add_request(make_request("big", 10, 10))
    assert not sched.has_unfinished()


def test_watchdog_logs_when_nothing_progresses(caplog):
    """When requests are pending and no step makes progress for the timeout, an error is logged once."""
    now = [0.0]
    sched = make_scheduler(watchdog_timeout_s=5.0, clock=lambda: now[0])
    sched.add_request(make_request("r", 4, 4))
    with caplog.at_level(logging.ERROR):
        sched.schedule()  # scheduled but the step never completes
        now[0] = 10.0
        sched.schedule()
    assert sched.stalled and "no request progressed" in caplog.text


def test_watchdog_does_not_count_idle_time(caplog):
    """A request arriving after a long idle period is not reported as stalled at its first step (it was: the
    watchdog counted from the last request before the idle period)."""
    now = [0.0]
    sched = make_scheduler(watchdog_timeout_s=5.0, clock=lambda: now[0])
    sched.add_request(make_request("first", 4, 4))
    sched.finish_request("first", FinishReason.ABORT)
    now[0] = 100.0  # idle; nothing calls the scheduler meanwhile
    sched.add_request(make_request("r", 4, 4))
    with caplog.at_level(logging.ERROR):
        sched.schedule()
    assert not sched.stalled and "no request progressed" not in caplog.text


def test_scheduled_chunk_is_decode():
    """A decode row: one new token after cached ones and no checkpoint to save; anything else is prefill."""
    def chunk(new: int, computed: int, checkpoints=()) -> ScheduledChunk:
        return ScheduledChunk(request_id="r", new_token_ids=[5] * new, num_computed_tokens=computed, state_slot=0,
                              block_ids=[0], checkpoints=checkpoints)

    assert chunk(1, 7).is_decode
    assert not chunk(1, 0).is_decode  # a one-token prompt
    assert not chunk(2, 7).is_decode
    assert not chunk(1, 7, ((1, 3),)).is_decode
