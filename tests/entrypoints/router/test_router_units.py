"""The router's parts without model instances: instance selection, the bodies it sends, its command lines, its
answers when no decode instance is up, and the launcher stopping everything when an instance fails to start."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from deltaserve.entrypoints.router.bodies import ROUTES, can_prefill_remotely, decode_body, prefill_body
from deltaserve.entrypoints.router.commands import add_parsers
from deltaserve.entrypoints.router.instances import InstancePool
from deltaserve.entrypoints.router.launcher import DisaggPlan, instance_command
from tests.entrypoints.router.helpers import API_KEY, start_router, stop_router
from tests.entrypoints.server_fixture import free_port

CHAT, COMPLETIONS, MESSAGES = ROUTES[0], ROUTES[1], ROUTES[2]


def test_pool_picks_least_in_flight_and_rotates_ties():
    """The healthy instance with the fewest requests in flight wins; idle instances are taken in turn."""
    pool = InstancePool("decode", ("http://a", "http://b", "http://c"))
    a, b, c = pool.instances
    assert [pool.pick().url for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2
    lease_a, lease_b = pool.acquire(a), pool.acquire(b)
    assert {pool.pick().url for _ in range(3)} == {"http://c"}
    pool.mark_down(c, "test")
    assert lease_a.down is a.down and not lease_a.down.is_set()
    lease_b.release()
    lease_b.release()  # idempotent
    assert b.in_flight == 0 and pool.pick().url == "http://b"
    assert pool.pick(exclude={"http://b"}).url == "http://a"
    assert pool.pick(exclude={"http://a", "http://b"}) is None
    lease_c = pool.acquire(c)
    pool.mark_down(c, "again")
    assert lease_c.down.is_set()  # a request on an instance that failed stops waiting for it
    pool.mark_up(c)
    assert c.healthy and not c.down.is_set() and lease_c.down.is_set()


def test_prefill_body_asks_one_token_and_a_transfer():
    """The prefill request: one token, not streamed, do_remote_decode; OpenAI fields a one-token request cannot
    take are dropped; the decode request is the client's with the prefill's params (or none)."""
    body = {"model": "m", "messages": [], "max_tokens": 50, "max_completion_tokens": 50, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3, "temperature": 0}
    out = prefill_body(CHAT, body)
    assert out == {"model": "m", "messages": [], "max_tokens": 1, "stream": False, "temperature": 0,
                   "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50  # the client's body is not changed
    anth = prefill_body(MESSAGES, {"model": "m", "messages": [], "max_tokens": 50, "stream": True, "top_k": 1})
    assert anth == {"model": "m", "messages": [], "max_tokens": 1, "stream": False, "top_k": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}
    params = {"do_remote_prefill": True, "transfer_id": "t"}
    assert decode_body({**body, "kv_transfer_params": {"x": 1}}, params) == {**body, "kv_transfer_params": params}
    assert decode_body({**body, "kv_transfer_params": {"x": 1}}, None) == body


def test_only_single_prompt_generation_requests_are_disaggregated():
    assert can_prefill_remotely(COMPLETIONS, {"prompt": "one"})
    assert can_prefill_remotely(COMPLETIONS, {"prompt": [1, 2, 3]})  # token ids of one prompt
    assert not can_prefill_remotely(COMPLETIONS, {"prompt": ["one", "two"]})
    assert not can_prefill_remotely(COMPLETIONS, {"prompt": [[1], [2]]})
    assert not can_prefill_remotely(CHAT, ["not", "an", "object"])
    assert not can_prefill_remotely(next(r for r in ROUTES if r.path == "/tokenize"), {"prompt": "x"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


def test_serve_disagg_passes_unknown_options_to_every_instance():
    """Options serve-disagg does not know reach each instance unchanged and in order, after its own."""
    args = _parser().parse_args(["serve-disagg", "--model", "/m", "--max-model-len", "64", "--prefill", "2",
                                 "--num-threads=1", "--prefix-caching", "--kv-connector", "tcp", "--port", "9"])
    assert (args.prefill, args.decode, args.port, args.kv_connector) == (2, 1, 9, "tcp")
    assert args.serve_args == ["--max-model-len", "64", "--num-threads=1", "--prefix-caching"]
    plan = DisaggPlan(model="/m", num_prefill=2, num_decode=1, kv_transfer_config={"kv_connector": "tcp"},
                      serve_args=tuple(args.serve_args))
    cmd = instance_command(plan, "prefill", 1234)
    assert cmd[1:5] == ["-m", "deltaserve.entrypoints.cli", "serve", "--model"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--kv-transfer-config") + 1] == '{"kv_connector": "tcp", "kv_role": "kv_producer"}'
    assert cmd[-4:] == args.serve_args
    assert '"kv_role": "kv_consumer"' in " ".join(instance_command(plan, "decode", 1))
    with pytest.raises(ValueError, match="--port is set by serve-disagg"):
        DisaggPlan(model=None, num_prefill=1, num_decode=1, serve_args=("--port=5",))
    with pytest.raises(SystemExit):  # the router needs a decode instance
        _parser().parse_args(["router", "--prefill", "http://a:1"])


@pytest.fixture(scope="module")
def orphan_router(tmp_path_factory):
    """A router whose only decode instance (and prefill instance) is a port nothing listens on."""
    nobody = f"http://127.0.0.1:{free_port()}"
    router = start_router(tmp_path_factory.mktemp("router-alone"), [nobody], [nobody])
    yield router
    stop_router(router)


def test_no_healthy_decode_instance_is_a_503_in_the_route_shape(orphan_router):
    """With no decode instance up: /health 503, and every route a 503 with its API's error body."""
    url = orphan_router.url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    with pytest.raises(openai.APIStatusError) as oai:
        openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
    assert oai.value.status_code == 503
    assert oai.value.body["code"] == "no_decode_instance" and oai.value.body["type"] == "service_unavailable"
    with pytest.raises(anthropic.APIStatusError) as anth:
        anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0).messages.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert anth.value.status_code == 503
    assert anth.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                         "message": anth.value.body["error"]["message"]}}
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert models.status_code == 503 and "error" in models.json()
    assert orphan_router.metric("requests_total", route="/v1/chat/completions") == 1


def test_serve_disagg_instance_that_fails_to_start_stops_the_rest(tmp_path):
    """An instance that exits during start-up is named with its exit status, the launcher exits with 2 and no
    instance is left running."""
    proc = subprocess.run(
        [sys.executable, "-m", "deltaserve.entrypoints.router.commands", "serve-disagg", "--model",
         str(tmp_path / "no-such-checkpoint"), "--prefill", "1", "--decode", "1", "--port", str(free_port()),
         "--num-threads", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"(prefill|decode)-0 \(http://127\.0\.0\.1:\d+\) exited during start-up with status \d+",
                     proc.stderr), proc.stderr[-3000:]
    pids = [int(p) for p in re.findall(r"started \w+-\d \(pid (\d+)\)", proc.stderr)]
    assert len(pids) == 2
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"instance {pid} left behind"
