"""Prefill/decode disaggregation at the engine level, on the tiny real models: a prefill engine computes a prompt
and publishes its cache (KV blocks and KDA state), a decode engine fetches it into its host tier and decodes, and
the greedy output equals a unified engine's, for prompts ending on and off a block boundary, with prefix-cache
hits on either side; a payload cut short, altered or gone is a local recompute with the same output; a tampered
state (a valid frame around the wrong state) changes the output, so the transferred state is really what the
decode side starts from; and nothing leaks."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from deltaserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from deltaserve.config.kv_transfer import prompt_digest
from deltaserve.engine.engine_core import EngineCore
from deltaserve.kvstore.entry import HEADER_SIZE, decode, encode
from deltaserve.sampling_params import SamplingParams
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CACHE = CacheConfig(block_size=16, state_checkpoint_interval=32, cache_memory="64MiB", host_cache_memory="16MiB")
SCHED = SchedulerConfig(max_num_batched_tokens=64)  # several chunks per prompt


def engine(path: str, role: str | None, *, connector: str = "tcp", timeout_s: float = 5.0, **kw: Any) -> EngineCore:
    kv = None if role is None else KVTransferConfig(kv_connector=connector, kv_role=role,
                                                    transfer_timeout_s=timeout_s)
    return EngineCore(EngineConfig(model=path, cache=kw.pop("cache", CACHE), scheduler=SCHED, kv_transfer_config=kv,
                                   num_threads=1, **kw))


def run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
        kv_transfer_params: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any] | None, int]:
    """(output ids, the last output's kv_transfer_params, num_cached_tokens) of one request run alone."""
    core.add_request(rid, prompt, params, kv_transfer_params=kv_transfer_params)
    ids: list[int] = []
    last = None
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None, out.error
            ids += out.new_token_ids
            last = out
    assert last is not None and last.finish_reason is not None
    return ids, last.kv_transfer_params, last.num_cached_tokens


def assert_nothing_held(core: EngineCore) -> None:
    usage = core.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots
    assert not core.cache._fetching and not core._sends


@pytest.fixture(scope="module")
def trio(tiny_dir):
    """(prefill engine, decode engine, unified engine) on the base tiny checkpoint."""
    path = str(tiny_dir("base"))
    cores = engine(path, "kv_producer"), engine(path, "kv_consumer"), engine(path, None)
    yield cores
    for core in cores:
        core.shutdown()


@pytest.mark.parametrize("length", [96, 101, 17, 2])  # on a block boundary + 1 (the handoff token), off, short
def test_disaggregated_equals_unified(trio, length):
    prefill, decode_, unified = trio
    prompt = prompt_ids(600, length, seed=length)
    want, _, _ = run(unified, f"u{length}", prompt)
    before = decode_.get_stats()
    _, params, _ = run(prefill, f"p{length}", prompt, kv_transfer_params={"do_remote_decode": True})
    assert params is not None and params["num_tokens"] == length - 1
    got, none, cached = run(decode_, f"d{length}", prompt, kv_transfer_params=params)
    assert got == want and none is None
    assert cached == length - 1  # the transferred prefix is the decode side's prefix hit: one token computed there
    after = decode_.get_stats()
    assert after.kv_transfer_received == before.kv_transfer_received + 1
    assert after.kv_transfer_received_state_bytes > before.kv_transfer_received_state_bytes
    assert after.kv_transfer_received_kv_bytes > before.kv_transfer_received_kv_bytes
    assert after.kv_transfer_failures == before.kv_transfer_failures
    for core in trio:
        assert_nothing_held(core)


def test_prefix_hits_on_either_side(trio):
    """A second request sharing a long prefix: the prefill side hits its own cache, the decode side hits what the
    first transfer left in its cache and fetches only the rest; a repeat of the same prompt on the decode side
    needs no fetch at all (counted as a fallback: computed locally)."""
    prefill, decode_, unified = trio
    base = prompt_ids(600, 80, seed=7)
    first, second = base + prompt_ids(600, 9, seed=8), base + prompt_ids(600, 21, seed=9)
    for i, prompt in enumerate([first, second]):
        want, _, _ = run(unified, f"hu{i}", prompt)
        _, params, cached_p = run(prefill, f"hp{i}", prompt, kv_transfer_params={"do_remote_decode": True})
        got, _, _ = run(decode_, f"hd{i}", prompt, kv_transfer_params=params)
        assert got == want
        if i == 1:
            assert cached_p >= 64  # the prefill side's own prefix cache served the shared part
    skipped = decode_.get_stats().kv_transfer_fallbacks
    received = decode_.get_stats().kv_transfer_received
    _, params, _ = run(prefill, "hp2", second, kv_transfer_params={"do_remote_decode": True})
    got, _, cached = run(decode_, "hd2", second, kv_transfer_params=params)
    assert got == run(unified, "hu2", second)[0] and cached == len(second) - 1
    assert decode_.get_stats().kv_transfer_fallbacks == skipped + 1
    assert decode_.get_stats().kv_transfer_received == received


def _republish(prefill: EngineCore, params: dict[str, Any], change) -> None:
    """Replace the published payload of `params` by `change(payload bytes) -> bytes | None` (None: a raw garbage
    frame), re-framed validly unless `change` returns the raw frame itself."""
    server = prefill.executor.worker.transfer_server
    key = params["transfer_id"] + "/r0of1"
    from deltaserve.kvtransfer.factory import make_client

    fetched = make_client(prefill.config.kv_transfer_config).fetch(params["remote_addresses"][0], key, 5.0)
    assert fetched is not None
    raw = bytes(fetched)
    from deltaserve.executor.shared_store import shared_namespace

    ns = shared_namespace(prefill.config)
    payload = decode(raw, ns, key)
    assert payload is not None
    server.publish(key, change(raw, payload, ns, key))


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other_layout"])
def test_damaged_transfer_is_recomputed(trio, damage):
    prefill, decode_, unified = trio
    prompt = prompt_ids(600, 70, seed=31 + len(damage))  # a prompt per case: the decode side caches what it computed
    want, _, _ = run(unified, f"du-{damage}", prompt)
    _, params, _ = run(prefill, f"dp-{damage}", prompt, kv_transfer_params={"do_remote_decode": True})
    assert params is not None

    def change(raw: bytes, payload: bytes, ns: str, key: str) -> bytes:
        if damage == "truncated":
            return raw[: HEADER_SIZE + len(payload) // 2]
        if damage == "flipped":
            return raw[:-1] + bytes([raw[-1] ^ 1])
        return encode("another-namespace", key, payload)

    _republish(prefill, params, change)
    failures = decode_.get_stats().kv_transfer_failures
    got, _, cached = run(decode_, f"dd-{damage}", prompt, kv_transfer_params=params)
    assert got == want and cached == 0
    assert decode_.get_stats().kv_transfer_failures == failures + 1
    assert_nothing_held(decode_)


def test_the_transferred_state_is_what_decoding_starts_from(trio):
    """A validly framed payload whose KDA state is zeroed (what a decode side that never received the state
    would hold) gives another output than unified: the test above would catch a decode side that ignored or
    zeroed the state. Its KV blocks are untouched, so only the state can make the difference."""
    prefill, decode_, unified = trio
    prompt = prompt_ids(600, 70, seed=41)
    want, _, _ = run(unified, "zu", prompt)
    _, params, _ = run(prefill, "zp", prompt, kv_transfer_params={"do_remote_decode": True})
    state_bytes = prefill.get_stats().kv_transfer_sent_state_bytes
    assert state_bytes > 0

    def zero_state(raw: bytes, payload: bytes, ns: str, key: str) -> bytes:
        from deltaserve.runner.shared_io import entry_bytes

        n = entry_bytes(prefill.executor.worker.runner.caches, "state")
        return encode(ns, key, payload[:-n] + bytes(n))

    _republish(prefill, params, zero_state)
    got, _, cached = run(decode_, "zd", prompt, kv_transfer_params=params)
    assert cached == len(prompt) - 1  # accepted: the frame is valid
    assert got != want


def test_handoff_token_fed_twice_would_show(trio):
    """The decode side computes the prompt's last token once, on the state after the others. Feeding it twice (the
    bug of engines that send the state after the whole prompt and recompute the last token) changes this
    checkpoint's output, so the equality tests above would catch it; and a transfer that claims the whole prompt
    is refused (computed locally, same output)."""
    prefill, decode_, unified = trio
    prompt = prompt_ids(600, 70, seed=51)
    want, _, _ = run(unified, "tu", prompt)
    assert run(unified, "tu2", prompt + prompt[-1:])[0] != want
    _, params, _ = run(prefill, "tp", prompt, kv_transfer_params={"do_remote_decode": True})
    claims_all = dict(params, num_tokens=len(prompt), prompt_digest=prompt_digest(prompt))
    fallbacks = decode_.get_stats().kv_transfer_fallbacks
    got, _, cached = run(decode_, "td", prompt, kv_transfer_params=claims_all)
    assert got == want and cached == 0
    assert decode_.get_stats().kv_transfer_fallbacks == fallbacks + 1


def test_prefill_instance_gone_is_a_recompute(tiny_dir):
    path = str(tiny_dir("base"))
    prefill, decode_ = engine(path, "kv_producer"), engine(path, "kv_consumer", timeout_s=2.0)
    try:
        prompt = prompt_ids(600, 50, seed=61)
        _, params, _ = run(prefill, "gp", prompt, kv_transfer_params={"do_remote_decode": True})
        prefill.shutdown()  # its transfer server closes: the fetch is refused
        got, _, cached = run(decode_, "gd", prompt, kv_transfer_params=params)
        assert cached == 0 and len(got) == GREEDY.max_tokens
        assert decode_.get_stats().kv_transfer_failures == 1
        assert_nothing_held(decode_)
    finally:
        decode_.shutdown()


def test_bad_kv_transfer_params_name_the_field(trio):
    _, decode_, _ = trio
    prompt = prompt_ids(600, 20, seed=71)
    for bad, field in [([1], "kv_transfer_params"), ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
                       ({"do_remote_prefill": True, "transfer_id": "x", "remote_addresses": [],
                         "num_tokens": 19, "prompt_digest": "d"}, "remote_addresses"),
                       ({"do_remote_prefill": True, "transfer_id": "x", "remote_addresses": ["tcp://h:1"],
                         "num_tokens": 0, "prompt_digest": "d"}, "num_tokens")]:
        with pytest.raises(ValueError, match=field):
            decode_.add_request("bad", prompt, GREEDY, kv_transfer_params=bad)
    assert not decode_.has_unfinished_requests()


def test_roles_without_the_config_compute_locally(trio):
    """do_remote_decode on an engine that is not a producer, or a transfer on one that is not a consumer: the
    request is simply computed there (the router then gets no kv_transfer_params and prefills on the decode side)."""
    prefill, decode_, unified = trio
    prompt = prompt_ids(600, 30, seed=81)
    want, params, _ = run(unified, "ru", prompt, kv_transfer_params={"do_remote_decode": True})
    assert params is None and len(want) == GREEDY.max_tokens
    _, params, _ = run(prefill, "rp", prompt, kv_transfer_params={"do_remote_decode": True})
    assert run(unified, "ru2", prompt, kv_transfer_params=params)[0] == want


def test_k3_disaggregated_equals_unified(tiny_dir):
    path = str(tiny_dir("k3"))
    cores = engine(path, "kv_producer"), engine(path, "kv_consumer"), engine(path, None)
    try:
        for length in (48, 53):
            prompt = prompt_ids(600, length, seed=90 + length)
            _, params, _ = run(cores[0], f"kp{length}", prompt, kv_transfer_params={"do_remote_decode": True})
            got, _, cached = run(cores[1], f"kd{length}", prompt, kv_transfer_params=params)
            assert got == run(cores[2], f"ku{length}", prompt)[0] and cached == length - 1
        for core in cores:
            assert_nothing_held(core)
    finally:
        for core in cores:
            core.shutdown()


def test_tensor_parallel_disaggregated_equals_unified(tiny_dir):
    """TP=2 on both sides (worker processes): each rank publishes and fetches its own heads' state and every other
    block (the latent cache is whole on each rank: each block moves once, the decode ranks all-gather them), and
    the decode side uses a transfer only when both ranks got theirs. The bytes moved are those of one rank."""
    from deltaserve.config import ParallelConfig

    path = str(tiny_dir("base"))
    tp2 = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp")
    cores = (engine(path, "kv_producer", parallel=tp2), engine(path, "kv_consumer", parallel=tp2), engine(path, None),
             engine(path, "kv_producer"))
    try:
        prompt = prompt_ids(600, 45, seed=99)  # 44 tokens transferred: 3 blocks of 16, the last one partial
        _, params, _ = run(cores[0], "tp", prompt, kv_transfer_params={"do_remote_decode": True})
        assert params is not None and len(params["remote_addresses"]) == 2
        got, _, cached = run(cores[1], "td", prompt, kv_transfer_params=params)
        assert got == run(cores[2], "tu", prompt)[0] and cached == len(prompt) - 1
        assert cores[1].get_stats().kv_transfer_received == 1
        run(cores[3], "t1", prompt, kv_transfer_params={"do_remote_decode": True})
        sent, sent_tp1, received = cores[0].get_stats(), cores[3].get_stats(), cores[1].get_stats()
        assert sent.kv_transfer_sent_kv_bytes == sent_tp1.kv_transfer_sent_kv_bytes > 0
        assert sent.kv_transfer_sent_state_bytes == sent_tp1.kv_transfer_sent_state_bytes > 0
        assert received.kv_transfer_received_kv_bytes == sent_tp1.kv_transfer_sent_kv_bytes
        assert received.kv_transfer_received_state_bytes == sent_tp1.kv_transfer_sent_state_bytes
        # rank 1's producer unreachable, rank 0's fine: neither rank uses the transfer (no hang), recomputed
        other = prompt_ids(600, 45, seed=98)
        _, params, _ = run(cores[0], "tp2", other, kv_transfer_params={"do_remote_decode": True})
        assert params is not None
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        params = {**params, "remote_addresses": [params["remote_addresses"][0], dead]}
        got, _, cached = run(cores[1], "td2", other, kv_transfer_params=params)
        assert got == run(cores[2], "tu2", other)[0] and cached == 0
        assert cores[1].get_stats().kv_transfer_failures == 1
    finally:
        for core in cores:
            core.shutdown()


class _GatedClient:
    """The real transfer client, whose fetches wait until `open` is set (the test sets it from the forward)."""

    def __init__(self, client: Any) -> None:
        self.client, self.open = client, threading.Event()
        self.waited_for_the_forward: list[bool] = []

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Any:
        # A bound only so that a broken overlap fails the test instead of hanging it: the forward opens the gate.
        self.waited_for_the_forward.append(self.open.wait(120))
        return self.client.fetch(address, transfer_id, timeout_s)

    def stats(self) -> Any:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()


def test_a_fetch_downloads_while_the_step_computes_the_running_requests(trio):
    """A running request's decode step runs its forward while a new request's payload downloads: the download waits
    for that forward (a fetch done before the forward, as it once was, would wait out the gate's bound and fail).
    The fetched request's output is still the unified one."""
    prefill, decode_, unified = trio
    runner = decode_.executor.worker.runner  # type: ignore[attr-defined]
    gated = _GatedClient(runner.transfer.client)
    forward = runner.execute_model

    def forward_then_open(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        finally:
            gated.open.set()

    runner.transfer.client, runner.execute_model = gated, forward_then_open
    try:
        prompt = prompt_ids(600, 70, seed=71)
        _, params, _ = run(prefill, "op", prompt, kv_transfer_params={"do_remote_decode": True})
        decode_.add_request("running", prompt_ids(600, 20, seed=72), GREEDY)
        while not any(o.new_token_ids for o in decode_.step()):  # "running" decodes from here on
            pass
        decode_.add_request("fetched", prompt, GREEDY, kv_transfer_params=params)
        got: dict[str, list[int]] = {"running": [], "fetched": []}
        cached = -1
        while decode_.has_unfinished_requests():
            for out in decode_.step():
                assert out.error is None, out.error
                got[out.request_id] += out.new_token_ids
                if out.request_id == "fetched":
                    cached = out.num_cached_tokens
        assert gated.waited_for_the_forward == [True]
        assert got["fetched"] == run(unified, "ou", prompt)[0] and cached == len(prompt) - 1
        assert_nothing_held(decode_)
    finally:
        runner.transfer.client, runner.execute_model = gated.client, forward
