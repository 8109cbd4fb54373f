"""StatePool: caps per kind, running slots lowest first and checkpoint slots highest first, reuse after free."""

from __future__ import annotations

import random

import pytest

from deltaserve.cache.state_pool import CHECKPOINT, RUNNING, StatePool


def test_running_slots_stay_consecutive_beside_checkpoints():
    """Interleaved running and checkpoint allocations (a prefill that saves a checkpoint) keep running slots
    consecutive, which is what lets the KDA decode update them in place."""
    pool = StatePool(num_slots=4, num_checkpoint_slots=4)
    got = [(pool.allocate(RUNNING), pool.allocate(CHECKPOINT)) for _ in range(4)]
    assert [r for r, _ in got] == [0, 1, 2, 3] and [c for _, c in got] == [7, 6, 5, 4]
    assert pool.allocate(RUNNING) is None and pool.allocate(CHECKPOINT) is None  # each kind at its cap
    pool.free(1)
    pool.free(6)
    assert pool.allocate(RUNNING) == 1 and pool.allocate(CHECKPOINT) == 6
    with pytest.raises(RuntimeError, match="not in use"):
        StatePool(2).free(0)


def test_random_churn_never_hands_out_a_used_slot():
    """Many random allocations, conversions and frees: every handed-out slot is free, counts match the caps."""
    rng = random.Random(0)
    pool = StatePool(num_slots=5, num_checkpoint_slots=7)
    used: dict[int, str] = {}
    for _ in range(5000):
        op = rng.random()
        if op < 0.45:
            kind = rng.choice([RUNNING, CHECKPOINT])
            slot = pool.allocate(kind)
            cap = 5 if kind == RUNNING else 7
            if slot is None:
                assert sum(k == kind for k in used.values()) == cap
            else:
                assert slot not in used and 0 <= slot < 12
                used[slot] = kind
        elif op < 0.55 and used:
            slot = rng.choice(sorted(used))
            if pool.convert(slot, CHECKPOINT):
                used[slot] = CHECKPOINT
        elif used:
            slot = rng.choice(sorted(used))
            pool.free(slot)
            del used[slot]
        assert pool.num_free == 5 - sum(k == RUNNING for k in used.values())
