"""The live status page through the real server: /status.json counts what the responses said, and the page as
headless Chromium renders it (its inline script fetching /status.json) shows the same numbers."""

from __future__ import annotations

import html.parser
import shutil
import subprocess

import httpx
import pytest

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Write a line about the sea."}]


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Values(html.parser.HTMLParser):
    """`data-key` -> (`data-value`, text) of every element the page's script filled, and the body's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, tuple[str | None, str]] = {}
        self.body: dict[str, str | None] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        key = a.get("data-key") if "data-value" in a else None
        if key is not None:
            self.values[key] = (a["data-value"], "")
        self._open.append(key)

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        key = self._open[-1] if self._open else None
        if key is not None:
            value, text = self.values[key]
            self.values[key] = (value, text + data)


def render_page(url: str, tmp_path) -> _Values:
    """The DOM of `url` after its script ran (virtual time lets the fetch and the first render finish)."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (CI installs Debian's chromium in .ci/run)")
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000", "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    parser = _Values()
    parser.feed(done.stdout)
    assert parser.body.get("data-rendered"), "the page's script never rendered /status.json:\n" + done.stdout[-2000:]
    return parser


def _status(server) -> dict:
    resp = httpx.get(f"{server.url}/status.json", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    return resp.json()


def _chat(server, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": USER, "max_tokens": 7, **extra}
    return httpx.post(f"{server.url}{CHAT}", json=body, headers=server.headers(), timeout=120)


def test_status_json_counts_what_the_responses_said(server):
    before = _status(server)
    usage = [_chat(server, seed=i).json()["usage"] for i in range(3)]
    with httpx.stream("POST", f"{server.url}{CHAT}", headers=server.headers(), timeout=120,
                      json={"model": "tiny", "messages": USER, "max_tokens": 5, "ignore_eos": True,
                            "stream": True}) as resp:
        assert resp.status_code == 200
        assert "data: [DONE]" in list(resp.iter_lines())
    assert _chat(server, temperature=-1).status_code == 400
    after = _status(server)
    done, was = after["totals"], before["totals"]
    assert done["sequences_finished"] - was["sequences_finished"] == 4
    assert done["generation_tokens"] - was["generation_tokens"] == sum(u["completion_tokens"] for u in usage) + 5
    assert done["prompt_tokens"] - was["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage) + usage[0][
        "prompt_tokens"]  # the streamed request has the same prompt
    assert done["errors_by_kind"].get("bad_request", 0) - was["errors_by_kind"].get("bad_request", 0) == 1
    assert after["latency"]["ttft"]["count"] >= 4 and after["latency"]["ttft"]["p50"] > 0
    assert after["latency"]["itl"]["count"] >= 4
    assert after["now"]["running"] == 0 and after["now"]["kv_blocks_used"] == 0
    assert after["engine_alive"] is True and after["uptime_s"] > 0


def test_rendered_page_shows_the_numbers_of_status_json(server, tmp_path):
    for i in range(3):
        assert _chat(server, seed=100 + i).status_code == 200
    assert _chat(server, temperature=-1).status_code == 400
    page = httpx.get(f"{server.url}/status", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")  # no external asset
    assert "src=" not in page.text and "<link" not in page.text
    dom = render_page(f"{server.url}/status", tmp_path)
    status = _status(server)  # the server is idle: its counters are what the page fetched
    for key in ("totals.sequences_finished", "totals.generation_tokens", "totals.prompt_tokens", "totals.errors",
                "totals.preemptions", "now.running", "now.waiting"):
        value: object = status
        for part in key.split("."):
            value = value[part]  # type: ignore[index]
        shown_value, shown_text = dom.values[key]
        assert shown_value == str(value), key
        assert shown_text == str(value), key  # integers are shown as they are
    assert int(status["totals"]["sequences_finished"]) >= 3
    assert dom.values["totals.prefix_hit_rate"][1].endswith("%")
    assert dom.values["latency.ttft.p50"][1].endswith(" ms")
    assert float(dom.values["uptime_s"][0] or 0) > 0
