"""A loopback HTTP server for image URL tests: `/img.png` (with Content-Length), `/undeclared` (the same bytes, no
Content-Length), `/missing` (404), `/stall` (headers, then nothing until the server stops), `/to?url=U` (302 to U)."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MediaServer:
    """What a running server serves and where; `url(path)` is an address on it."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.released = threading.Event()
        """Set when the server stops: a /stall request then ends."""
        self.stalled = threading.Event()
        """Set when a /stall request has sent its headers."""
        self.port = 0

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def media_server(body: bytes) -> Iterator[MediaServer]:
    """Serves `body` on a free loopback port while the context is open."""
    state = MediaServer(body)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            parts = urllib.parse.urlsplit(self.path)
            if parts.path == "/img.png":
                self._send(200, {"Content-Type": "image/png", "Content-Length": str(len(state.body))}, state.body)
            elif parts.path == "/undeclared":
                self._send(200, {"Content-Type": "image/png"}, state.body)
            elif parts.path == "/to":
                self._send(302, {"Location": urllib.parse.parse_qs(parts.query)["url"][0], "Content-Length": "0"})
            elif parts.path == "/stall":
                self.send_response(200)
                self.send_header("Content-Length", str(len(state.body)))
                self.end_headers()
                self.wfile.flush()
                state.stalled.set()
                state.released.wait()
            else:
                self._send(404, {"Content-Length": "0"})

        def _send(self, code: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(code)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.released.set()
        server.shutdown()
        server.server_close()
        thread.join()
