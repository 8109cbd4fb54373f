"""The host tier (L2) of the prefix cache, without a model: evicted blocks and checkpoints are demoted into it
(one device -> host copy each), a later lookup finds them there and promotes them (host -> device copies, the blocks
findable on the device again), entries being promoted are pinned, LRU within the tier, nothing leaks."""

from __future__ import annotations

from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.manager import CacheManager, HostRef
from tests.cache.test_prefix_cache import BS, req, run_prefill


def manager(num_blocks: int = 12, host_blocks: int = 32, host_slots: int = 8) -> CacheManager:
    return CacheManager(num_blocks=num_blocks, num_slots=4, block_size=BS, num_checkpoint_slots=2,
                        bytes_per_slot=100, enable_prefix_caching=True, checkpoint_interval=8,
                        num_host_blocks=host_blocks, num_host_slots=host_slots)


PROMPT = list(range(100, 130))  # 30 tokens, 8 blocks of 4
OTHER = list(range(500, 540))


def test_evicted_prefix_is_demoted_and_comes_back_from_the_host():
    m = manager()
    first = req(PROMPT)
    run_prefill(m, first)
    m.take_host_copies()
    m.free(first)  # its state kept as a checkpoint at 30 (older checkpoints demoted to make room)
    early = m.take_host_copies()
    assert early is not None and not early.blocks_out  # no block evicted yet: none copied (write-back)
    other = req(OTHER)
    run_prefill(m, other)  # needs 10 of the 12 device blocks and both checkpoint slots: evicts the first prompt's
    out = m.take_host_copies()
    m.free(other, save_state=False)
    assert out is not None and out.blocks_out and out.states_out
    assert len({h for _, h in out.blocks_out}) == len(out.blocks_out)
    stats = m.prefix_stats()
    assert stats.host_blocks_demoted == len(out.blocks_out)
    assert stats.host_checkpoints_demoted == len(early.states_out) + len(out.states_out)

    again = req(PROMPT + [1, 2, 3])
    hit = m.match(again)
    assert hit.length == 30 and hit.uses_host
    assert isinstance(hit.checkpoint, HostRef)
    assert m.allocate(again.request_id, again.num_prompt_tokens, hit)
    copies = m.take_host_copies()
    assert copies is not None and copies.states_in == [(hit.checkpoint.host_id, m.slot(again.request_id))]
    host_blocks = [b for b in hit.blocks if isinstance(b, HostRef)]
    own = m.block_ids(again.request_id)
    assert [(h, d) for h, d, rows in copies.blocks_in if rows == BS] == [
        (b.host_id, own[i]) for i, b in enumerate(hit.blocks) if isinstance(b, HostRef)]
    # The promoted blocks are findable on the device again: a second identical request needs no host copy.
    m.end_step()
    assert m.prefix_stats().host_hit_tokens == 30 and host_blocks


def test_entries_being_promoted_are_not_evicted_by_the_same_steps_demotions():
    tier = HostTier(num_blocks=2, num_slots=1)
    a, b, c = (1, None), (2, None), (3, None)
    ha, hb = tier.store_block(a), tier.store_block(b)
    assert ha is not None and hb is not None
    tier.pin_block(a)
    hc = tier.store_block(c)  # full: evicts the LRU unpinned entry, b
    assert hc == hb and tier.full_block(1) == ha and tier.full_block(2) is None
    tier.pin_block(c)
    assert tier.store_block((4, None)) is None  # everything pinned: no room, nothing overwritten
    tier.end_step()
    assert tier.store_block((4, None)) is not None


def test_partial_blocks_and_checkpoints_are_found_in_the_host_tier():
    tier = HostTier(num_blocks=4, num_slots=2)
    h = tier.store_block((7, (1, 2)))
    assert tier.partial_blocks(7) == {(1, 2): h}
    s = tier.store_checkpoint((7, (1, 2)), 6)
    entry = tier.checkpoint((7, (1, 2)))
    assert entry is not None and entry.host_id == s and entry.length == 6
    assert tier.store_checkpoint((7, (1, 2)), 6) is None  # already held: no second copy


def test_long_random_run_leaks_nothing():
    """Many requests with shared prefixes, aborts (freed without saving) and reuse: afterwards every device block and
    slot is free, the host tier holds at most its capacity, and every host id is held once."""
    import random

    rng = random.Random(0)
    m = manager(num_blocks=16, host_blocks=10, host_slots=3)
    bases = [list(range(1000 * k, 1000 * k + 24)) for k in range(4)]
    for _ in range(200):
        r = req(rng.choice(bases)[: rng.randint(5, 24)] + [rng.randint(0, 50) for _ in range(rng.randint(0, 9))])
        hit = m.match(r)
        if not m.allocate(r.request_id, r.num_prompt_tokens, hit):
            continue
        r.num_computed_tokens = hit.length
        m.take_copies(), m.take_host_copies()
        r.num_computed_tokens = r.num_prompt_tokens
        m.end_step()
        m.commit(r)
        m.free(r, save_state=rng.random() < 0.7)
        m.take_host_copies()
    usage = m.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots
    for tier in (m.host.blocks, m.host.checkpoints):
        ids = [e.host_id for e in tier.entries.values()]
        assert len(ids) == len(set(ids)) <= tier.capacity
        assert all(e.pins == 0 for e in tier.entries.values())
    assert m.prefix_stats().host_blocks_promoted > 0


class _Lookup:
    """A store's existence check for the prefetch bookkeeping: every key but the `missing` ones."""

    def __init__(self, missing: set[str] | None = None) -> None:
        self.missing, self.calls = missing or set(), 0

    def contains(self, key: str) -> bool:
        self.calls += 1
        return key not in self.missing


def test_prefetch_reserves_fetches_then_publishes_what_arrived():
    """A prompt the store holds: host entries reserved (invisible), the request waits a step, the fetched ones are
    published; a block that failed to arrive is dropped and the hit stops before it."""
    store = _Lookup()
    m = CacheManager(num_blocks=64, num_slots=4, block_size=BS, num_checkpoint_slots=4, bytes_per_slot=100,
                     enable_prefix_caching=True, checkpoint_interval=8, num_host_blocks=32, num_host_slots=8,
                     shared=store)
    r = req(list(range(300, 341)))  # 41 tokens: 10 full blocks below the last token
    assert m.prefetch(r) and m.prefetch(r)  # waits until the step's fetches are published
    ops = m.take_shared_ops()
    assert ops is not None and [k for k, _, _ in ops.fetches].count("kv") == 10 and ops.fetches[-1][0] == "state"
    assert store.calls < 10  # bisection, plus the state lookup
    assert m.match(r).length == 0  # reserved entries are invisible until published
    results = [True] * len(ops.fetches)
    results[6] = False  # block 6 did not arrive
    m.finish_fetches(results)
    assert not m.prefetch(r)  # probed once: admitted now
    # Blocks 0-5 are back but block 6 is not, and no state sits at block 6: no hit reaches past it.
    assert m.match(r).length == 0 and m.shared_fetched == len(ops.fetches) - 1 and m.shared_fetch_failures == 1
    assert len(m.host.blocks.entries) == 9 and all(e.pins == 0 for e in m.host.blocks.entries.values())
