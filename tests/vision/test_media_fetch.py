"""Image URLs: http(s) fetched from a loopback server within the allow-list, the size limit and the deadline
(redirects re-checked), file URLs only inside the allowed directory; every refusal an `ImageError` of its kind."""

from __future__ import annotations

import os
import time
import urllib.parse
from pathlib import Path

import pytest

from deltaserve.multimodal import ImageError
from deltaserve.multimodal.media_fetch import FetchPolicy, fetch_image_bytes
from tests.vision.images import encode, shapes
from tests.vision.media_server import media_server

PNG = encode(shapes(56, 84), "PNG")


def _refused(kind: str, url: str, policy: FetchPolicy) -> str:
    with pytest.raises(ImageError) as err:
        fetch_image_bytes(url, policy)
    assert err.value.kind == kind, err.value
    return str(err.value)


def test_http_fetch_with_and_without_content_length() -> None:
    with media_server(PNG) as server:
        assert fetch_image_bytes(server.url("/img.png"), FetchPolicy()) == PNG
        assert fetch_image_bytes(server.url("/undeclared"), FetchPolicy()) == PNG
        assert "HTTP 404" in _refused("fetch_failed", server.url("/missing"), FetchPolicy())


def test_size_limit_declared_or_counted() -> None:
    small = FetchPolicy(max_bytes=len(PNG) - 1)
    with media_server(PNG) as server:
        assert "--max-image-bytes" in _refused("too_large", server.url("/img.png"), small)
        assert "--max-image-bytes" in _refused("too_large", server.url("/undeclared"), small)
        assert fetch_image_bytes(server.url("/img.png"), FetchPolicy(max_bytes=len(PNG))) == PNG


def test_a_stalled_server_is_a_failure_within_the_timeout() -> None:
    with media_server(PNG) as server:
        start = time.monotonic()
        message = _refused("fetch_failed", server.url("/stall"), FetchPolicy(timeout_s=0.5))
        assert server.stalled.is_set() and "0.5 s" in message
        assert time.monotonic() - start < 30  # bounded (not a hang); its exact length is the machine's business


def test_allowed_domains_and_redirects() -> None:
    only_loopback = FetchPolicy(allowed_domains=("127.0.0.1",))
    with media_server(PNG) as server:
        assert fetch_image_bytes(server.url("/img.png"), only_loopback) == PNG
        assert "--allowed-media-domains" in _refused("disallowed_url", server.url("/img.png", "localhost"),
                                                     only_loopback)
        # a redirect to an allowed host is followed; one to another host is refused, not fetched
        to_allowed = server.url("/to?url=" + urllib.parse.quote(server.url("/img.png")))
        assert fetch_image_bytes(to_allowed, only_loopback) == PNG
        to_other = server.url("/to?url=" + urllib.parse.quote(server.url("/img.png", "localhost")))
        assert "--allowed-media-domains" in _refused("disallowed_url", to_other, only_loopback)
        to_file = server.url("/to?url=" + urllib.parse.quote("file:///etc/hostname"))
        # urllib itself refuses a redirect to another scheme (an HTTP error): not fetched either way
        assert "302" in _refused("fetch_failed", to_file, FetchPolicy(local_root="/"))


def test_unreachable_and_other_schemes() -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _refused("fetch_failed", f"http://127.0.0.1:{port}/x.png", FetchPolicy(timeout_s=2))
    _refused("disallowed_url", "ftp://example.com/x.png", FetchPolicy())
    _refused("disallowed_url", "http:///no-host.png", FetchPolicy())


def test_file_urls_only_inside_the_allowed_directory(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    (root / "cat.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    os.symlink(outside / "secret.png", root / "link.png")
    policy = FetchPolicy(local_root=str(root))
    assert fetch_image_bytes((root / "cat.png").as_uri(), policy) == PNG
    assert "--allowed-local-media-path" in _refused("disallowed_url", (root / "cat.png").as_uri(), FetchPolicy())
    _refused("disallowed_url", f"file://{root}/../private/secret.png", policy)
    _refused("disallowed_url", (root / "link.png").as_uri(), policy)  # a symlink out is resolved first
    _refused("disallowed_url", f"file://otherhost{root}/cat.png", policy)
    _refused("fetch_failed", (root / "missing.png").as_uri(), policy)
    _refused("fetch_failed", root.as_uri(), policy)  # a directory
    _refused("too_large", (root / "cat.png").as_uri(), FetchPolicy(local_root=str(root), max_bytes=10))
