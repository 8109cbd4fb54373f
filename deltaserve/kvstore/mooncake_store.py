"""The Mooncake Store backend (`mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata`).

`mooncake.store.MooncakeDistributedStore` (pip `mooncake-transfer-engine-non-cuda`, or the CUDA build
`mooncake-transfer-engine` on GPU machines, plus Debian's `libibverbs1`) is imported when a store opens. The master
(`mooncake_master`) keeps only metadata; the bytes live in memory segments that clients mount: each engine process
contributes `global_segment_size` bytes (0: none), and a dedicated pool process (`mooncake_client
-global_segment_size 4GB -master_server_address ... -metadata_server ...`) keeps entries when engines restart.
An entry whose segment goes away (its process exits) is gone; so is everything when the master restarts (it has no
persistence without its HA mode): both are misses.

Query fields (all optional but `metadata`): `metadata` (the metadata server: `http://HOST:PORT/metadata` for the
master's own HTTP server, `etcd://...`, or `P2PHANDSHAKE`), `protocol` (`tcp`; `rdma` with `device_name`),
`local_hostname` (the address other clients reach this one at; default: this host's address on the route to the
master), `global_segment_size` (bytes this process contributes; default 512 MiB), `local_buffer_size` (the
registered staging buffer every put and get goes through; default room for two maximal entries at once).

Limits: Mooncake has no per-entry expiry. The TTL is enforced on read from the entry header (an expired entry is a
miss and is removed); memory is bounded by the mounted segments, and the master evicts when they fill
(`-eviction_high_watermark_ratio`, `-eviction_ratio`) any entry whose lease has run out (`-default_kv_lease_ttl`,
10 s after its last access by default). The client-side `max_entry_bytes` bounds a put.

Blocking: a call into the C++ client can block for long (a put with the master gone: about 4 s; any call with the
master frozen: 30 s, its RPC timeout). put / get / exists / remove release the GIL, so the caller's worker thread
with a timeout bounds them. `setup` and `close` hold the GIL while they block (90 s for a setup against an
unreachable master, 9 s for a close with a frozen one), which no thread can bound: so both first probe the master's
RPC port and its HTTP metadata server with the store's timeout, and are not called when either does not answer
(a client whose close is skipped is kept referenced, never destroyed: its destructor would block the same way).
A master that freezes between the probe and the call can still stall the process for those times.
"""

from __future__ import annotations

import http.client
import importlib
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from deltaserve.kvstore.backend import StoreOpError, StoreUnavailable
from deltaserve.kvstore.entry import HEADER_SIZE

DEFAULT_GLOBAL_SEGMENT_SIZE = 512 << 20
# Mooncake's ErrorCode values that mean the master or a peer is unreachable (mooncake-store/include/types.h):
# INTERNAL_ERROR, SEGMENT_NOT_FOUND, CLIENT_NOT_FOUND, TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT. Any other code is a
# refusal of this one call (no space: -200, a value over the local buffer: -600 / -10, not found: -704).
_OUTAGE_CODES = frozenset({-1, -101, -103, -800, -900, -901})
_QUERY_FIELDS = {"metadata", "protocol", "local_hostname", "global_segment_size", "local_buffer_size", "device_name"}


@dataclass(frozen=True)
class MooncakeAddress:
    """A parsed `mooncake://` URL."""

    master: str
    metadata: str
    protocol: str = "tcp"
    local_hostname: str | None = None
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int | None = None
    device_name: str = ""


def parse_mooncake_url(url: str) -> MooncakeAddress:
    """The address of a `mooncake://` URL; ValueError naming `shared_cache_url` and the bad part otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake":
        raise ValueError(f"shared_cache_url: expected mooncake://MASTER_HOST:PORT?metadata=URL, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"shared_cache_url: bad master port in {url!r}") from None
    if not parts.hostname or port is None:
        raise ValueError(f"shared_cache_url: mooncake:// needs the master's HOST:PORT, got {url!r}")
    query = {name: values[-1] for name, values in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - _QUERY_FIELDS
    if unknown:
        raise ValueError(f"shared_cache_url: unknown mooncake:// field(s) {sorted(unknown)} in {url!r} "
                         f"(known: {sorted(_QUERY_FIELDS)})")
    if not query.get("metadata"):
        raise ValueError(f"shared_cache_url: mooncake:// needs ?metadata=http://HOST:PORT/metadata, got {url!r}")
    sizes: dict[str, int] = {}
    for name in ("global_segment_size", "local_buffer_size"):
        if name in query:
            if not query[name].isdigit():
                raise ValueError(f"shared_cache_url: {name} must be a byte count, got {query[name]!r} in {url!r}")
            sizes[name] = int(query[name])
    return MooncakeAddress(
        master=f"{parts.hostname}:{port}", metadata=query["metadata"], protocol=query.get("protocol") or "tcp",
        local_hostname=query.get("local_hostname") or None,
        global_segment_size=sizes.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
        local_buffer_size=sizes.get("local_buffer_size"), device_name=query.get("device_name", ""))


def _route_address(host: str) -> str:
    """This host's address on the route to `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _probe(address: MooncakeAddress, timeout_s: float) -> None:
    """StoreUnavailable unless the master's RPC port accepts and its HTTP metadata server (when it is one) answers,
    each within `timeout_s`."""
    host, port = address.master.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise StoreUnavailable(f"master {address.master}: {exc}") from None
    meta = urlsplit(address.metadata)
    if meta.scheme not in ("http", "https") or not meta.hostname:
        return
    conn_type = http.client.HTTPSConnection if meta.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(meta.hostname, meta.port, timeout=timeout_s)
    try:
        conn.request("GET", f"{meta.path or '/'}?key=deltaserve-probe")
        conn.getresponse().read()  # any status: 404 "metadata not found" is an answer
    except (OSError, http.client.HTTPException) as exc:
        raise StoreUnavailable(f"metadata server {address.metadata}: {exc or type(exc).__name__}") from None
    finally:
        conn.close()


# Clients whose close was skipped (their master did not answer, or a call is still blocked in them): kept so that
# no destructor runs (see above).
_ABANDONED: list[object] = []


def _check(code: int, what: str) -> None:
    if code == 0:
        return
    if code in _OUTAGE_CODES:
        raise StoreUnavailable(f"{what}: Mooncake error {code}")
    raise StoreOpError(f"{what}: Mooncake error {code}")


class MooncakeBackend:
    """One `MooncakeDistributedStore` client, set up on first use (and again after a failed setup)."""

    def __init__(self, url: str, *, max_entry_bytes: int, timeout_s: float) -> None:
        self.address = parse_mooncake_url(url)
        self._timeout_s = timeout_s
        self.name = f"mooncake://{self.address.master}"
        try:
            self._module: Any = importlib.import_module("mooncake.store")
        except ImportError as exc:
            raise ImportError(
                "shared_cache_url: mooncake:// needs the Mooncake store: pip install 'deltaserve[mooncake]' "
                "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1") from exc
        self._buffer_size = self.address.local_buffer_size or 2 * (max_entry_bytes + HEADER_SIZE) + (16 << 20)
        self._client: Any = None
        self._setup_lock = threading.Lock()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def _store(self) -> Any:
        if self._client is not None:
            return self._client
        with self._setup_lock:
            if self._client is None:
                a = self.address
                _probe(a, self._timeout_s)  # setup holds the GIL while it waits for an unreachable master
                client = self._module.MooncakeDistributedStore()
                host = a.local_hostname or _route_address(a.master.rsplit(":", 1)[0])
                code = client.setup(host, a.metadata, a.global_segment_size, self._buffer_size, a.protocol,
                                    a.device_name, a.master)
                if code != 0:
                    raise StoreUnavailable(f"setup against master {a.master} failed (code {code})")
                self._client = client
        return self._client

    @contextmanager
    def _use(self) -> Iterator[Any]:
        """The client, counted as in use: close never destroys it under a call still running (one that ran past
        its caller's timeout), which would crash the process."""
        with self._idle:
            if self._closed:
                raise StoreUnavailable("closed")
            self._in_flight += 1
        try:
            yield self._store()
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def put(self, key: str, parts: Sequence[bytes], ttl_s: float | None) -> None:
        del ttl_s  # no per-entry expiry in Mooncake: enforced on read from the entry header
        with self._use() as client:
            _check(client.upsert_parts(key, *parts), "put")

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._use() as client:
            values = [bytes(v) if v else None for v in client.get_batch(list(keys))]
            # An empty answer is both "absent" and "failed": the existence check tells which.
            empty = [k for k, v in zip(keys, values, strict=True) if v is None]
            found = client.batch_is_exist(empty) if empty else []
        for code in found:
            if code < 0:
                _check(code, "get")
            if code == 1:
                raise StoreOpError("get: an existing key returned no bytes (its segment may have gone)")
        return values

    def exists(self, key: str) -> bool:
        with self._use() as client:
            found = client.is_exist(key)
        if found < 0:
            _check(found, "contains")
        return found == 1

    def delete(self, key: str) -> None:
        with self._use() as client:
            code = client.remove(key, True)
        if code != -704:  # OBJECT_NOT_FOUND: already gone
            _check(code, "delete")

    def close(self) -> None:
        with self._idle:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._in_flight == 0, timeout=self._timeout_s)
        client, self._client = self._client, None
        if client is None:
            return
        if not idle:
            _ABANDONED.append(client)
            raise StoreUnavailable("calls still blocked in the client: not closed")
        try:
            _probe(self.address, self._timeout_s)  # close, too, holds the GIL while the master does not answer
        except StoreUnavailable:
            _ABANDONED.append(client)
            raise
        client.close()
