"""The data-parallel router (engine/dp_router.py) and the DP client's pure parts: stats merge, replica configs."""

from __future__ import annotations

import pytest

from deltaserve.engine.dp_client import merge_stats, replica_config, replica_env
from deltaserve.engine.dp_router import Router
from deltaserve.engine.stats import EngineStats

B = 4  # tokens per block


def prompt(first: int, blocks: int) -> list[int]:
    return [first * 1000 + i for i in range(blocks * B)]


def test_least_loaded_picks_the_fewest_in_flight_and_rotates_ties():
    router = Router(3, block_size=B, session_affinity=False)
    assert router.route(prompt(1, 2), [5, 2, 7]) == 1
    picks = [router.route(prompt(1, 2), [0, 0, 0]) for _ in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[3:] == picks[:3]  # a sequential client is spread out
    assert router.route(prompt(1, 2), [None, 3, None]) == 1  # dead replicas are skipped
    with pytest.raises(ValueError, match="every data-parallel replica is dead"):
        router.route(prompt(1, 2), [None, None, None])


def test_a_follow_up_that_extends_a_prompt_goes_to_the_same_replica_while_the_match_is_worth_the_load():
    router = Router(2, block_size=B, tokens_per_request=B)  # one request of imbalance per matched block
    first = prompt(1, 5)
    owner = router.route(first, [0, 0])
    other = 1 - owner
    loads = [0, 0]
    loads[owner] = 5  # five blocks matched: worth five requests more than the other replica
    assert router.route(first + prompt(2, 3), loads) == owner
    assert router.route(prompt(3, 5), loads) == other  # unrelated: the least loaded
    loads[owner] = 6
    assert router.route(first + prompt(4, 3), loads) == other  # not worth six


def test_a_finished_sequence_is_remembered_with_its_output():
    """The next turn of a chat starts with the previous prompt + answer: the key of that whole sequence, recorded
    at finish, is a longer match than the prompt's own keys (worth more load)."""
    turn1, answer = prompt(1, 3), prompt(2, 6)
    follow_up = turn1 + answer + prompt(3, 2)
    picks = []
    for record_finish in (True, False):
        router = Router(2, block_size=B, tokens_per_request=B)
        r1 = router.route(turn1, [0, 0])
        if record_finish:
            router.finished(turn1 + answer, r1)
        loads = [0, 0]
        loads[r1] = 5  # more than the 3 blocks of the prompt are worth, less than the 9 of prompt + answer
        picks.append(router.route(follow_up, loads) == r1)
    assert picks == [True, False]


def test_a_shared_system_prompt_spreads_sessions_over_the_replicas():
    """New sessions that share only a short system prompt pile on its replica only while that is worth the load;
    once one goes elsewhere both replicas hold the prompt and the next ones take the less loaded. Each session's
    follow-up then returns to its own replica."""
    router = Router(2, block_size=B, tokens_per_request=2 * B)
    system = prompt(0, 2)  # two blocks: worth one request of imbalance
    loads = [0, 0]
    owners = []
    for s in range(4):
        r = router.route(system + prompt(s + 1, 2), loads)
        loads[r] += 1
        owners.append(r)
    assert owners == [0, 0, 1, 1] and loads == [2, 2]
    for s in range(4):
        assert router.route(system + prompt(s + 1, 2) + prompt(9, 1), loads) == owners[s]


def test_session_id_wins_over_prefixes_and_load_limits_affinity():
    router = Router(2, block_size=B, max_imbalance=2)
    a = router.route(prompt(1, 2), [0, 0], session_id="alice")
    assert router.route(prompt(7, 2), [0, 0] if a == 1 else [1, 0], session_id="alice") == a
    loads = [0, 0]
    loads[a] = 2  # within max_imbalance of the other: still affine
    assert router.route(prompt(8, 2), loads, session_id="alice") == a
    loads[a] = 3  # beyond it: the least loaded replica, which owns the session from now on
    assert router.route(prompt(8, 2), loads, session_id="alice") == 1 - a
    assert router.route(prompt(8, 2), [0, 0], session_id="alice") == 1 - a


def test_forget_drops_a_dead_replicas_entries_and_sessions_move():
    router = Router(2, block_size=B)
    a = router.route(prompt(1, 4), [0, 0], session_id="s")
    assert router.owners()[a] > 0
    dropped = router.forget(a)
    assert dropped > 0 and router.owners()[a] == 0
    loads: list[int | None] = [0, 0]
    loads[a] = None
    b = router.route(prompt(1, 4), loads, session_id="s")
    assert b == 1 - a
    # Revived later: the session stays where it went.
    assert router.route(prompt(1, 4), [5, 5], session_id="s") == b


def test_maps_are_bounded_least_recently_used():
    router = Router(2, block_size=B, max_entries=8)
    for i in range(50):
        router.route(prompt(i, 3), [0, 0], session_id=f"s{i}")
    assert sum(router.owners().values()) <= 16


def test_short_prompts_have_no_prefix_key():
    router = Router(2, block_size=B)
    assert router.block_keys([1, 2, 3]) == []
    assert len(router.block_keys(list(range(9)))) == 2
    assert router.block_keys(list(range(8))) == router.block_keys(list(range(9)))


def stats(**kw: object) -> EngineStats:
    base = dict(num_running=1, num_waiting=2, kv_blocks_used=3, kv_blocks_total=10, state_slots_used=1,
                state_slots_total=4, prefix_queried_tokens=100, prefix_hit_tokens=40, num_preemptions=1, steps=7)
    return EngineStats(**{**base, **kw})  # type: ignore[arg-type]


def test_merge_stats_adds_every_field():
    merged = merge_stats([stats(spec_accepted_per_pos=(1, 2)), stats(steps=3, spec_accepted_per_pos=(5,))])
    assert merged.num_running == 2 and merged.kv_blocks_total == 20 and merged.steps == 10
    assert merged.prefix_hit_tokens == 80 and merged.spec_accepted_per_pos == (6, 2)
    with pytest.raises(ValueError):
        merge_stats([])


def test_clear_forgets_everything():
    router = Router(2, block_size=B)
    router.route(prompt(1, 4), [0, 0], session_id="s")
    router.clear()
    assert not router.owners()


def config(**kw: object):
    from deltaserve.config import EngineConfig, ParallelConfig

    parallel = {k: v for k, v in kw.items() if k in ("data_parallel_size", "tensor_parallel_size",
                                                     "distributed_executor_backend")}
    rest = {k: v for k, v in kw.items() if k not in parallel}
    return EngineConfig(model="/nonexistent", parallel=ParallelConfig(**parallel), **rest)  # type: ignore[arg-type]


def test_replica_config_splits_the_cpu_threads_and_is_one_replica():
    one = replica_config(config(data_parallel_size=2, num_threads=5))
    assert one.num_threads == 2 and one.parallel.data_parallel_size == 1
    assert replica_config(config(data_parallel_size=4, num_threads=2)).num_threads == 1
    assert replica_config(config(data_parallel_size=2, device="cuda")).num_threads is None


def test_replica_env_gives_each_replica_its_own_gpus(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replica_env(config(data_parallel_size=2), 1) == {}  # a CPU
    cuda = config(data_parallel_size=2, tensor_parallel_size=2, device="cuda")
    assert [replica_env(cuda, i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                        {"CUDA_VISIBLE_DEVICES": "2,3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_env(cuda, 1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert replica_env(config(data_parallel_size=2, device="cuda:1"), 1) == {}  # an explicit device for all
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match="needs 4 GPUs but CUDA_VISIBLE_DEVICES lists 3"):
        replica_env(cuda, 1)
