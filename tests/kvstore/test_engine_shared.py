"""The shared store (L3) behind the engine, with a real Redis and a real Mooncake Store: a second engine's first
request for a prefix the first engine computed is a shared-store hit, with outputs identical to no caching (Kimi
Linear and K3, prompts ending on and off a block boundary); a corrupted entry and a killed store make requests
recompute with the same outputs, counted, never an error."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from deltaserve import LLM, SamplingParams
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, state_checkpoint_interval=32, max_num_batched_tokens=256)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """(output ids, cached tokens) of each prompt, one request at a time."""
    out = []
    for p in prompts:
        r = llm.generate([p], GREEDY)[0]
        out.append((list(r.outputs[0].token_ids), r.num_cached_tokens))
    return out


def drain(llm: LLM) -> None:
    """Wait for the writer's background puts (the in-process worker's)."""
    llm.engine.executor.worker.runner.shared.drain()


@pytest.mark.parametrize("variant", ["base", pytest.param("k3", marks=pytest.mark.slow)])  # CI time
def test_second_engine_hits_what_the_first_computed(store_server, tiny_dir, variant):
    path = str(tiny_dir(variant))
    prompts = [prompt_ids(600, 96, seed=11), prompt_ids(600, 101, seed=12)]  # on and off a block boundary
    reference = [ids for ids, _ in tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE), prompts)]
    first = LLM(model=path, shared_cache_url=store_server.url, **ENGINE)
    assert [ids for ids, _ in tokens(first, prompts)] == reference
    drain(first)
    second = LLM(model=path, shared_cache_url=store_server.url, **ENGINE)
    got = tokens(second, prompts)
    assert [ids for ids, _ in got] == reference
    assert [cached for _, cached in got] == [80, 96]  # the last full block of each (a state there), from the store
    stats = second.engine.cache.prefix_stats()
    assert stats.host_hit_tokens == 176 and second.engine.cache.shared_fetch_failures == 0
    engine_stats = second.engine.get_stats()
    assert engine_stats.shared_fetched > 0 and engine_stats.shared_fetch_failures == 0
    # the store's own counters, as /metrics shows them: every fetch one get that hit, with its bytes and latency
    assert engine_stats.shared_get_hits == engine_stats.shared_fetched <= engine_stats.shared_gets
    assert engine_stats.shared_get_bytes > 0 and engine_stats.shared_get_seconds > 0
    assert engine_stats.shared_errors == engine_stats.shared_corrupt == 0


def test_a_corrupt_entry_or_a_dead_store_recomputes(store_server, tiny_dir):
    path = str(tiny_dir("base"))
    prompt = prompt_ids(600, 64, seed=21)
    reference = tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE), [prompt])[0][0]
    first = LLM(model=path, shared_cache_url=store_server.url, **ENGINE)
    tokens(first, [prompt])
    drain(first)
    # Corrupt every entry of this prompt the writer made (its keys: the namespace, then kv/ or state/, then rank).
    store = first.engine.shared_store
    keys = [k for k in first.engine.cache._put_keys]
    for key in keys:
        store_server.raw_set(f"{store.namespace}/{key}/r0of1", b"not an entry")
    second = LLM(model=path, shared_cache_url=store_server.url, **ENGINE)
    (ids, cached), = tokens(second, [prompt])
    assert ids == reference and cached == 0
    assert second.engine.cache.shared_fetch_failures > 0
    assert second.engine.get_stats().shared_fetch_failures == second.engine.cache.shared_fetch_failures
    assert second.engine.get_stats().shared_corrupt > 0
    assert second.engine.executor.worker.runner.shared.store.stats.corrupt > 0
    first.shutdown()
    second.shutdown()
    if store_server.kind != "redis":
        return  # a Mooncake client whose master died blocks in C++ for seconds per call (bounded, but slow); the
        # store-level outage tests cover Mooncake (tests/kvstore/test_guarded.py)
    # The store killed: requests still succeed, with the same outputs, from recompute.
    store_server.kill()
    try:
        third = LLM(model=path, shared_cache_url=store_server.url, shared_cache_timeout_s=0.5, **ENGINE)
        (ids, cached), = tokens(third, [prompt])
        assert ids == reference and cached == 0
    finally:
        store_server.restart()


class _GatedStore:
    """The real store, whose gets wait until `open` is set (the test sets it from the forward)."""

    def __init__(self, store: Any) -> None:
        self.store, self.open = store, threading.Event()
        self.waited_for_the_forward: list[bool] = []

    def put(self, key: str, value: bytes) -> bool:
        return self.store.put(key, value)

    @property
    def stats(self) -> Any:
        return self.store.stats

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        # A bound only so that a broken overlap fails the test instead of hanging it: the forward opens the gate.
        self.waited_for_the_forward.append(self.open.wait(120))
        return self.store.get_many(keys)


def test_store_reads_happen_while_the_step_computes_the_running_requests(store_server, tiny_dir):
    """A second engine fetches a prefix from the store while a request of its own decodes: the reads wait for that
    step's forward (reads done before it, as they once were, would wait out the gate's bound and fail); the hit's
    output is the no-cache one."""
    path = str(tiny_dir("base"))
    prompt = prompt_ids(600, 96, seed=13)
    reference = tokens(LLM(model=path, enable_prefix_caching=False, **ENGINE), [prompt])[0][0]
    first = LLM(model=path, shared_cache_url=store_server.url, **ENGINE)
    tokens(first, [prompt])
    drain(first)
    core = LLM(model=path, shared_cache_url=store_server.url, **ENGINE).engine
    runner = core.executor.worker.runner  # type: ignore[attr-defined]
    gated = _GatedStore(runner.shared.store)
    forward = runner.execute_model

    def forward_then_open(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        finally:
            gated.open.set()

    runner.shared.store, runner.execute_model = gated, forward_then_open
    core.add_request("running", prompt_ids(600, 20, seed=14), GREEDY)
    while not any(o.new_token_ids for o in core.step()):  # "running" decodes from here on
        pass
    core.add_request("hit", prompt, GREEDY)
    got: dict[str, list[int]] = {"running": [], "hit": []}
    cached = -1
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.request_id == "hit":
                cached = out.num_cached_tokens
    assert gated.waited_for_the_forward and all(gated.waited_for_the_forward)
    assert got["hit"] == reference and cached == 80  # the last full block with a state, from the store
