"""End to end: a request of megabytes is rendered and tokenized off the event loop, and a client that stops reading
a stream does not make the server buffer its output without bound.

The server runs a tiny checkpoint whose tokenizer is in Kimi's own format (`tiktoken.model`, as real Kimi checkpoints
ship it) and whose context is raised to 1M tokens, so that an 8 MB prompt passes the cheap length check and is
really tokenized.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer
from tests.conftest import TINY_VARIANTS
from tests.entrypoints.server_fixture import API_KEY, LiveServer, start_server, stop_server

BIG_BODY_BYTES = 8 * 2**20
MAX_UNREAD = 64


@pytest.fixture(scope="module")
def long_server(tiny_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-tiktoken-1m") / "model"
    shutil.copytree(tiny_dir("base"), model)
    write_tiny_tokenizer(model, TINY_VARIANTS["base"].vocab, fmt="tiktoken")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_max_length": 1 << 20}))
    live = start_server(model, tmp_path_factory.mktemp("server-long"), "--max-unread-stream-tokens", str(MAX_UNREAD),
                        "--max-request-bytes", str(BIG_BODY_BYTES + 2**20))
    yield live
    stop_server(live)


def _raw_post(server: LiveServer, path: str, body: bytes, rcvbuf: int | None = None) -> socket.socket:
    """A connection with `body` POSTed on it (sent whole); the response is the caller's to read."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the TCP window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _probed(server: LiveServer, body: bytes) -> tuple[bytes, list[float], float, float]:
    """POST `body` to the chat route while probing /health. Returns the response, the round trips of the probes that
    finished before it arrived (the longest is the event loop's longest stall), the seconds until it arrived, and
    the longest of 200 probes of the idle server before."""
    with httpx.Client(base_url=server.url, timeout=120) as probe:  # the same probes on an idle server
        idle = []
        for _ in range(200):
            start = time.perf_counter()
            probe.get("/health")
            idle.append(time.perf_counter() - start)
    response: list[bytes] = []
    sent = time.perf_counter()
    sock = _raw_post(server, "/v1/chat/completions", body)  # returns once the whole body is handed to TCP
    reader = threading.Thread(target=lambda: response.append(_read_all(sock)))
    reader.start()
    probes_during: list[float] = []
    with httpx.Client(base_url=server.url, timeout=120) as probe:
        while reader.is_alive():
            start = time.perf_counter()
            status = probe.get("/health").status_code
            took = time.perf_counter() - start
            if not response:  # the big response had not arrived when this probe finished
                probes_during.append(took)
            assert status == 200
    reader.join()
    sock.close()
    assert probes_during, "no /health probe finished while the 8 MB request was processed"
    return response[0], probes_during, time.perf_counter() - sent, max(idle)


def _context_exceeded(response: bytes) -> None:
    # tokenizing stops once the prompt passes the 1M-token context, so the error knows only that it has more (the
    # whole id list, whose list work held the loop for 100+ ms, is never built)
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    error = json.loads(payload)["error"]
    assert error["code"] == "context_length_exceeded" and f"more than {1 << 20} tokens" in error["message"], error


def test_an_8mb_prompt_does_not_stall_the_event_loop(long_server):
    """While an 8 MB chat body is tokenized, /health keeps answering: probes complete before the big response
    arrives. The longest probe round trip is the event loop's longest stall (docs/benchmarks.md)."""
    words = "the scheduler gives each request tokens under a budget; "
    content = (words * (BIG_BODY_BYTES // len(words)))[:BIG_BODY_BYTES - 200]
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}).encode()
    assert len(body) <= BIG_BODY_BYTES
    response, probes, total, idle = _probed(long_server, body)
    _context_exceeded(response)  # 8 MB of this text is ~3.9M tokens
    print(f"\n8 MB chat request answered in {total:.2f} s; {len(probes)} /health probes meanwhile, the longest "
          f"took {max(probes) * 1000:.1f} ms (the longest of 200 on the idle server: {idle * 1000:.1f} ms)")


def test_8mb_of_small_messages_do_not_stall_the_event_loop(long_server):
    """The same with 8 MB of 60,000 small messages, whose validation (not parsing) is the long part (0.7-1.2 s on the
    loop before it moved to the render threads with the parse)."""
    text = "a short turn of a long agentic session, one of very many in this request; " * 2
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"{i}: {text}"} for i in range(BIG_BODY_BYTES // 200)]
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": turns}).encode()
    assert BIG_BODY_BYTES * 0.8 < len(body) <= BIG_BODY_BYTES
    response, probes, total, idle = _probed(long_server, body)
    _context_exceeded(response)
    print(f"\n8 MB of {len(turns)} messages answered in {total:.2f} s; {len(probes)} /health probes meanwhile, the "
          f"longest took {max(probes) * 1000:.1f} ms (the longest of 200 on the idle server: {idle * 1000:.1f} ms)")


def test_a_prompt_past_the_context_is_refused_where_rendering_passes_it(server):
    """Text that passes the cheap character check but renders past max_model_len (the session server: 2,048
    tokens) is refused by every generation route once the render passes the limit: a 400 context_length_exceeded
    saying "more than 2048 tokens" (streamed requests too, before their stream starts). /tokenize and count_tokens
    still count it exactly, and truncate_prompt_tokens, which keeps the tail of the whole prompt, still serves it."""
    tokenizer = Tokenizer.from_pretrained(server.model_dir)
    max_token_bytes = max(len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size))
    words = "the scheduler gives each request tokens under a budget; "
    text = (words * (2048 * max_token_bytes // len(words)))[:2048 * max_token_bytes]  # at the character check
    user = [{"role": "user", "content": text}]
    count = _post(server, "/tokenize", {"model": "tiny", "messages": user}).json()["count"]
    assert count > 2048
    assert _post(server, "/v1/messages/count_tokens", {"model": "tiny", "messages": user}).json()["input_tokens"] > 2048
    for path, body, param in (
        ("/v1/chat/completions", {"messages": user, "max_tokens": 1}, "messages"),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 1, "stream": True}, "messages"),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", text], "max_tokens": 1}, "prompt"),
        ("/v1/messages", {"messages": user, "max_tokens": 1}, "messages"),
    ):
        r = _post(server, path, {"model": "tiny", **body})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert "more than 2048 tokens" in error["message"], error
        if not path.startswith("/v1/messages"):  # Anthropic's error body has neither field
            assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    served = _post(server, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1,
                                               "truncate_prompt_tokens": 100})
    assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] == 100, served.text


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=120)


def test_a_client_that_stops_reading_gets_its_request_aborted(long_server):
    """A streaming client that reads nothing more: the server aborts the request once MAX_UNREAD generated
    tokens wait unread (logged), instead of buffering the whole output; the engine is then free for others."""
    # 64 sequences with 20 logprobs per token: ~35 kB of events per step, past the socket buffers (a few MB, which
    # hold what a stalled client leaves before the server's writes wait) within a couple of hundred steps
    body = json.dumps({"model": "tiny", "prompt": ["Slow readers"] * 16, "n": 4, "max_tokens": 1000, "stream": True,
                       "logprobs": 20, "ignore_eos": True}).encode()
    sock = _raw_post(long_server, "/v1/completions", body, rcvbuf=4096)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream started; from here on nothing is read
    log: Path = long_server.log
    deadline = time.monotonic() + 300
    while "generated tokens unread" not in (text := log.read_text()):
        assert time.monotonic() < deadline, f"no abort logged:\n{text[-3000:]}"
        time.sleep(0.2)
    line = next(line for line in text.splitlines() if "generated tokens unread" in line)
    assert f"the limit is {MAX_UNREAD}" in line
    sock.close()
    # the engine is not busy with the abandoned request: a new one completes
    done = httpx.post(f"{long_server.url}/v1/completions", headers=long_server.headers(), timeout=120,
                      json={"model": "tiny", "prompt": "Next", "max_tokens": 3, "ignore_eos": True})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
