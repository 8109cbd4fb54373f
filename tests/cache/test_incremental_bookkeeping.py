"""Per-step bookkeeping that costs what a step adds, not the context: the lazily extended chain hashes, checkpoint
positions planned per step range, `BlockList` epochs and the runner's block-table mirror built from them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from deltaserve.cache.block_hash import chain_hashes
from deltaserve.cache.block_pool import BlockList
from deltaserve.cache.manager import CacheManager
from deltaserve.request import Request
from deltaserve.runner.input_batch import InputBatch
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import ScheduledChunk


def _request(rid: str, prompt_len: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=[(i * 7 + 3) % 101 for i in range(prompt_len)],
                   params=SamplingParams(max_tokens=4), stop_token_ids=frozenset(), arrival_index=0,
                   max_total_tokens=prompt_len + 4)


def test_hashes_extended_step_by_step_equal_hashing_at_once() -> None:
    """Hashes grown a few blocks at a time (as chunks complete) equal the chain hashed in one go."""
    m = CacheManager(num_blocks=64, num_slots=2, block_size=4, enable_prefix_caching=True)
    r = _request("r", 90)
    for n in (1, 2, 2, 7, 15, 22):
        m.hashes(r, n)
    assert m.hashes(r, 22) == chain_hashes(r.prompt_token_ids, 4)[:22]
    assert m.hashes(r, 5) == chain_hashes(r.prompt_token_ids, 4)[:5]


@pytest.mark.parametrize("interval", [None, 8, 12])
@pytest.mark.parametrize("prompt_len", [1, 9, 33, 48, 50])
def test_checkpoints_planned_per_range_cover_the_prompt_once(interval: int | None, prompt_len: int) -> None:
    """Positions planned chunk by chunk are the prompt's planned positions, each once: every interval below the
    prompt's end and its last full block."""
    m = CacheManager(num_blocks=64, num_slots=2, block_size=4, num_checkpoint_slots=32, enable_prefix_caching=True,
                     checkpoint_interval=interval)
    r = _request("r", prompt_len)
    step = interval or prompt_len
    expected = sorted({p for p in range(step, prompt_len, step)} | {(prompt_len - 1) // 4 * 4} - {0})
    assert m.planned_positions(r) == expected
    assert m.allocate("r", prompt_len)
    planned = []
    for start in range(0, prompt_len, 5):  # chunks of 5 tokens
        end = min(start + 5, prompt_len)
        planned += [start + offset for offset, _ in m.plan_checkpoints(r, start, end)]
    assert planned == expected


def test_block_list_epoch_changes_only_when_entries_go() -> None:
    """Appends keep the epoch; a truncation that drops ids and a new list get new ones; copies and pickles keep it."""
    a = BlockList([3, 1, 4])
    epoch = a.epoch
    a.extend([1, 5])
    a.truncate(9)
    assert a.epoch == epoch
    assert a.snapshot() == a and a.snapshot().epoch == epoch and a.snapshot() is not a
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.epoch == epoch
    a.truncate(2)
    assert a == [3, 1] and a.epoch != epoch
    assert BlockList(a).epoch != a.epoch


def _tables(batch: InputBatch, chunks: list[ScheduledChunk]) -> list[list[int]]:
    """The block table row of each chunk, in chunk order."""
    _, fb, order = batch.build(chunks)
    rows = fb.block_tables.tolist()
    return [rows[order.index(i)] for i in range(len(chunks))]


def _chunk(rid: str, blocks: list[int], computed: int) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, new_token_ids=[1, 2], num_computed_tokens=computed, state_slot=0,
                          block_ids=blocks)


def test_block_table_mirror_follows_appends_truncations_and_new_lists() -> None:
    """The runner's block tables equal the chunks' block ids after appends, a truncation followed by re-growth to
    the same length with other ids, a new list for the same request, and plain lists; rows are zero past the ids."""
    batch = InputBatch(block_size=4, device=torch.device("cpu"), max_num_tokens=8, max_num_seqs=2)
    live = BlockList([7, 8])
    other = [5]
    for _ in range(40):  # grow past the mirror's first buffer
        live.append(len(live) + 10)
        tables = _tables(batch, [_chunk("a", live.snapshot(), 4 * len(live) - 2), _chunk("b", other, 2)])
        assert tables[0] == list(live)
        assert tables[1] == other + [0] * (len(live) - 1)
    live.truncate(len(live) - 3)
    live.extend([90, 91, 92])  # same length as before, different tail
    assert _tables(batch, [_chunk("a", live.snapshot(), 4 * len(live) - 2)])[0] == list(live)
    fresh = BlockList([60, 61])  # e.g. the request was preempted and re-admitted
    assert _tables(batch, [_chunk("a", fresh, 6)])[0] == [60, 61]
    assert np.array_equal(_tables(batch, [_chunk("a", [1, 2, 3], 10)])[0], [1, 2, 3])
