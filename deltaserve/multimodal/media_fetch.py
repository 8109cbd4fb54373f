"""Image bytes from a URL a client sent: http(s) fetched under a wall-clock deadline and a size limit, only from the
allowed hosts (every redirect checked too), `file://` only inside the allowed local directory. Every refusal is an
`ImageError`, so the API answers 400 naming the content part whatever went wrong."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException, HTTPMessage, HTTPResponse
from typing import IO

from deltaserve.multimodal.errors import ImageError

_CHUNK = 1 << 16
_MAX_REDIRECTS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchPolicy:
    """Where image URLs may point and how much may be read (`MediaConfig` in the API process)."""

    allowed_domains: tuple[str, ...] | None = None
    """Hosts http(s) URLs may name (lower case, exact match); None: any."""
    local_root: str = ""
    """The directory `file://` URLs may name files under; empty: file URLs are refused."""
    timeout_s: float = 5.0
    max_bytes: int = 32 * 2**20


def fetch_image_bytes(url: str, policy: FetchPolicy) -> bytes:
    """The bytes `url` (http, https or file) names.

    Raises:
        ImageError: `disallowed_url` (another scheme, a host not allowed, a file outside the allowed directory or no
            directory allowed), `fetch_failed` (unreachable, an HTTP error status, past the deadline, no such file),
            `too_large` (more than `policy.max_bytes`).
    """
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    if scheme == "file":
        return _read_file(url, policy)
    raise ImageError("disallowed_url", f"image URLs must be http(s), file or base64 data URLs, got {url!r:.80}")


def _check_host(url: str, policy: FetchPolicy) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ImageError("disallowed_url", f"not an http(s) URL with a host: {url!r:.80}")
    host = parts.hostname.lower().rstrip(".")
    if policy.allowed_domains is not None and host not in policy.allowed_domains:
        raise ImageError("disallowed_url", f"image URL host {host!r} is not in --allowed-media-domains")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed http(s) host (else the allow-list would be one redirect away)."""

    max_redirections = _MAX_REDIRECTS

    def __init__(self, policy: FetchPolicy) -> None:
        self._policy = policy

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage,
                         newurl: str) -> urllib.request.Request | None:
        _check_host(newurl, self._policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch_http(url: str, policy: FetchPolicy) -> bytes:
    _check_host(url, policy)
    deadline = time.monotonic() + policy.timeout_s
    opener = urllib.request.build_opener(_CheckedRedirects(policy))
    request = urllib.request.Request(url, headers={"User-Agent": "deltaserve", "Accept": "image/*"})
    try:
        # The timeout bounds each socket operation; the loop below bounds the whole read (a server that drips).
        with opener.open(request, timeout=policy.timeout_s) as response:
            return _read_body(response, url, policy, deadline)
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageError("fetch_failed", f"fetching the image URL answered HTTP {exc.code}") from None
    except (urllib.error.URLError, HTTPException, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ImageError):  # a refused redirect, wrapped by urllib on some paths
            raise reason from None
        timed_out = isinstance(reason, socket.timeout | TimeoutError)
        raise ImageError("fetch_failed", f"the image URL could not be fetched"
                         f"{f' within {policy.timeout_s:g} s' if timed_out else ''}: {reason}") from None


def _read_body(response: HTTPResponse, url: str, policy: FetchPolicy, deadline: float) -> bytes:
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise ImageError("too_large", f"the image at the URL has {declared} bytes, more than the limit "
                         f"{policy.max_bytes} (--max-image-bytes)")
    chunks, size = [], 0
    while chunk := response.read(_CHUNK):
        size += len(chunk)
        if size > policy.max_bytes:
            raise ImageError("too_large", f"the image at the URL has more than {policy.max_bytes} bytes "
                             "(--max-image-bytes)")
        if time.monotonic() > deadline:
            raise ImageError("fetch_failed", f"the image URL took longer than {policy.timeout_s:g} s to read")
        chunks.append(chunk)
    return b"".join(chunks)


def _read_file(url: str, policy: FetchPolicy) -> bytes:
    if not policy.local_root:
        raise ImageError("disallowed_url", "file URLs are refused unless the server sets --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError("disallowed_url", f"a file URL must name a local path, got host {parts.netloc!r:.40}")
    root = os.path.realpath(policy.local_root)
    path = os.path.realpath(urllib.request.url2pathname(parts.path))  # symlinks and '..' resolved before the check
    if os.path.commonpath([root, path]) != root:
        raise ImageError("disallowed_url", "the file URL names a path outside --allowed-local-media-path")
    if not os.path.isfile(path):  # before opening: a FIFO would block the open
        raise ImageError("fetch_failed", "the file URL does not name a regular file")
    try:
        with open(path, "rb") as file:
            data = file.read(policy.max_bytes + 1)
    except OSError as exc:
        raise ImageError("fetch_failed", f"the file URL could not be read: {exc.strerror}") from None
    if len(data) > policy.max_bytes:
        raise ImageError("too_large", f"the image file has more than {policy.max_bytes} bytes (--max-image-bytes)")
    return data
