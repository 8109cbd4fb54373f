"""Prefix cache bookkeeping without a model: hit lengths, checkpoints, partial blocks, eviction, pinning."""

from __future__ import annotations

from deltaserve.cache.manager import CacheManager
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams

BS = 4


def manager(num_blocks: int = 32, ckpt_slots: int = 4, interval: int = 8) -> CacheManager:
    return CacheManager(num_blocks=num_blocks, num_slots=4, block_size=BS, num_checkpoint_slots=ckpt_slots,
                        bytes_per_slot=100, enable_prefix_caching=True, checkpoint_interval=interval)


_n = iter(range(10**6))


def req(tokens: list[int], rid: str | None = None) -> Request:
    return Request(request_id=rid or f"r{next(_n)}", prompt_token_ids=list(tokens), params=SamplingParams(max_tokens=4),
                   stop_token_ids=frozenset(), arrival_index=next(_n), max_total_tokens=10_000)


def run_prefill(m: CacheManager, r: Request, chunk: int = 100) -> list[tuple[int, int]]:
    """Admit r with its hit, 'compute' its prompt in chunks, and return the checkpoints planned on the way."""
    hit = m.match(r)
    assert m.allocate(r.request_id, r.num_prompt_tokens, hit)
    r.num_computed_tokens = hit.length
    planned = []
    while r.num_computed_tokens < r.num_prompt_tokens:
        end = min(r.num_computed_tokens + chunk, r.num_prompt_tokens)
        planned += [(r.num_computed_tokens + p, s) for p, s in m.plan_checkpoints(r, r.num_computed_tokens, end)]
        m.take_copies()
        r.num_computed_tokens = end
        m.end_step()
        m.commit(r)
    return planned


PROMPT = list(range(100, 130))  # 30 tokens: blocks end at 4, 8, ..., 28


def test_checkpoints_at_interval_and_last_full_block():
    """A prefill plans checkpoints every `interval` tokens and at the last full block of the prompt."""
    m = manager()
    planned = run_prefill(m, req(PROMPT))
    assert [p for p, _ in planned] == [8, 16, 24, 28]
    assert m.prefix_stats().checkpoints_stored == 4


def test_hit_is_the_longest_valid_prefix():
    """An identical prompt hits at the last checkpoint below its length; a diverging one at the last before it."""
    m = manager()
    first = req(PROMPT)
    run_prefill(m, first)
    m.free(first, save_state=False)
    assert m.match(req(PROMPT)).length == 28
    diverged = PROMPT[:21] + [7, 7, 7, 7, 7]  # shares 21 tokens: blocks up to 20, checkpoint at 16
    assert m.match(req(diverged)).length == 16
    assert m.match(req(PROMPT[:9])).length == 8  # capped at len - 1 = 8, and a checkpoint exists there
    assert m.match(req([1, 2, 3, 4, 5])).length == 0


def test_end_of_request_checkpoint_with_partial_block():
    """A finished request leaves a checkpoint at its computed length; the next turn hits it and copies the
    partial block and the state."""
    m = manager()
    turn1 = req(PROMPT)
    run_prefill(m, turn1)
    turn1.output_token_ids += [1, 2, 3]  # 33 tokens, 32 computed (the last sampled token never is)
    m.allocate(turn1.request_id, 33)
    turn1.num_computed_tokens = 32
    m.commit(turn1)
    turn1.output_token_ids += [4]
    turn1.num_computed_tokens = 33  # computed up to a partial block (33 % 4 == 1)
    m.free(turn1)
    turn2 = req(PROMPT + [1, 2, 3, 4, 9, 9, 9])
    hit = m.match(turn2)
    assert hit.length == 33 and hit.partial_block is not None and len(hit.blocks) == 8
    assert m.allocate(turn2.request_id, turn2.num_prompt_tokens, hit)
    block_copies, state_copies = m.take_copies()
    assert block_copies == [(hit.partial_block, m.block_ids(turn2.request_id)[8], 1)]
    assert state_copies == [(hit.checkpoint.slot, m.slot(turn2.request_id))]
    m.end_step()


def test_evicted_checkpoint_shortens_the_hit():
    """With one checkpoint slot, the deepest checkpoint is kept; a later prompt evicts it and the hit is gone."""
    m = manager(ckpt_slots=1)
    first = req(PROMPT)
    run_prefill(m, first)
    m.free(first, save_state=False)
    assert m.prefix_stats().checkpoints_stored == 1
    assert m.match(req(PROMPT)).length == 28  # the deepest position was the one kept
    assert m.match(req(PROMPT[:21] + [0] * 5)).length == 0  # 8 and 16 were never stored
    other = req(list(range(700, 730)))
    run_prefill(m, other)
    m.free(other, save_state=False)
    assert m.prefix_stats().checkpoint_evictions == 1
    assert m.match(req(PROMPT)).length == 0


def test_pinned_checkpoint_survives_eviction_in_its_step():
    """A checkpoint being copied this step is never evicted, even when every slot is wanted."""
    m = manager(ckpt_slots=1)
    first = req(PROMPT)
    run_prefill(m, first)
    m.free(first, save_state=False)
    second = req(PROMPT)
    hit = m.match(second)
    assert m.allocate(second.request_id, 30, hit)
    third = req(list(range(500, 540)))
    assert m.allocate(third.request_id, 40)
    assert m.plan_checkpoints(third, 0, 40) == []  # the only slot holds the pinned checkpoint
    m.take_copies()
    m.end_step()
    assert hit.checkpoint.pins == 0
    assert m.plan_checkpoints(third, 0, 40) != []  # unpinned now: evicted for the new one


def test_everything_returns_after_free():
    """After requests finish, all running slots and all blocks are free (cached blocks count as evictable)."""
    m = manager()
    rs = [req(PROMPT), req(PROMPT[:17] + [5] * 10)]
    for r in rs:
        run_prefill(m, r)
    for r in rs:
        m.free(r)
    usage = m.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots
    assert m.prefix_stats().cached_blocks > 0


def test_cached_blocks_are_evicted_only_when_needed():
    """Allocation uses never-cached blocks first and evicts cached ones least recently used first."""
    m = manager(num_blocks=10)
    first = req(PROMPT)  # 8 blocks, 7 full cached
    run_prefill(m, first)
    m.free(first, save_state=False)
    other = req(list(range(900, 916)))  # needs 4 blocks: the 3 never-cached ones + 1 evicted
    assert m.allocate(other.request_id, 16)
    assert m.blocks.num_evictions == 1
