"""Block tables sent to worker processes as deltas (`executor/block_sync.py`): over a random history of appends,
truncations, new lists and finished requests the worker's lists equal the scheduler's after a pickle round trip
each step; a step that appends one block to a 65,536-block list sends a few ids, not the list; a receiver that lost
track refuses the step."""

from __future__ import annotations

import pickle
import random

import pytest

from deltaserve.cache.block_pool import BlockList
from deltaserve.executor.block_sync import BlockDeltaStep, BlockTableReceiver, BlockTableSender
from deltaserve.scheduler.output import ScheduledChunk, SchedulerOutput


def chunk(rid: str, ids: list[int]) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, new_token_ids=[1], num_computed_tokens=1, state_slot=0, block_ids=ids)


def wire(step: BlockDeltaStep) -> BlockDeltaStep:
    return pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))


def test_random_history_round_trips_and_is_forgotten():
    rng = random.Random(0)
    sender, receiver = BlockTableSender(), BlockTableReceiver()
    lists: dict[str, BlockList] = {}
    finished: list[str] = []
    sent_ids = full_ids = 0
    for step in range(400):
        for _ in range(rng.randrange(3)):  # new requests (an id may come back after it finished)
            lists[f"r{rng.randrange(12)}"] = BlockList(rng.randrange(1000) for _ in range(rng.randrange(1, 5)))
        for ids in lists.values():
            roll = rng.random()
            if roll < 0.6:
                ids.extend(rng.randrange(1000) for _ in range(rng.randrange(3)))
            elif roll < 0.7:
                ids.truncate(rng.randrange(1, len(ids) + 1))  # a rollback (new epoch when ids are dropped)
        for rid in rng.sample(sorted(lists), k=min(len(lists), rng.randrange(2))):
            finished.append(rid)
            del lists[rid]
        scheduled = [rid for rid in lists if rng.random() < 0.8]
        out = SchedulerOutput(chunks=[chunk(rid, lists[rid].snapshot()) for rid in scheduled],
                              finished_request_ids=finished)
        finished = []
        encoded = wire(sender.encode(out))
        sent_ids += sum(len(t.ids) for t in encoded.tails.values())
        full_ids += sum(len(lists[rid]) for rid in scheduled)
        decoded = receiver.decode(encoded)
        assert [c.request_id for c in decoded.chunks] == scheduled
        for c in decoded.chunks:
            assert isinstance(c.block_ids, BlockList)
            assert list(c.block_ids) == list(lists[c.request_id]), (step, c.request_id)
            assert c.block_ids.epoch == lists[c.request_id].epoch
    assert sent_ids < full_ids / 3  # mostly tails
    receiver.decode(wire(sender.encode(SchedulerOutput(chunks=[], finished_request_ids=sorted(lists)))))
    assert sender.num_tracked == receiver.num_tracked == 0


def test_one_appended_block_of_a_long_list_sends_one_id():
    sender, receiver = BlockTableSender(), BlockTableReceiver()
    ids = BlockList(range(65_536))
    first = pickle.dumps(sender.encode(SchedulerOutput(chunks=[chunk("long", ids.snapshot())])))
    receiver.decode(pickle.loads(first))
    ids.append(70_000)
    step = sender.encode(SchedulerOutput(chunks=[chunk("long", ids.snapshot())]))
    assert step.tails["long"].ids == [70_000] and step.tails["long"].start == 65_536
    second = pickle.dumps(step)
    assert len(first) > 100_000 and len(second) < 2_000
    decoded = receiver.decode(pickle.loads(second))
    assert list(decoded.chunks[0].block_ids) == list(ids)


def test_plain_lists_and_plain_outputs_pass_through():
    receiver = BlockTableReceiver()
    out = SchedulerOutput(chunks=[chunk("a", [3, 4])])
    assert receiver.decode(out) is out
    step = BlockTableSender().encode(out)
    assert step.tails == {} and receiver.decode(step).chunks[0].block_ids == [3, 4]


def test_a_receiver_out_of_sync_refuses_the_step():
    sender = BlockTableSender()
    ids = BlockList([1, 2])
    BlockTableReceiver().decode(sender.encode(SchedulerOutput(chunks=[chunk("a", ids.snapshot())])))
    ids.append(3)
    with pytest.raises(RuntimeError, match="block table of request 'a' out of sync"):
        BlockTableReceiver().decode(sender.encode(SchedulerOutput(chunks=[chunk("a", ids.snapshot())])))
