"""The entry format of the shared store: a fixed header, then the payload.

Header (little-endian, `HEADER_SIZE` bytes): magic `DSKV`, format version, header size, payload length, expiry
(unix milliseconds, 0 = never), a digest of the namespace, a digest of the full key, and a CRC-32 of the header
fields before it and the payload.
`decode` refuses (returns None with a reason) a truncated or oversized entry, another format, another namespace's
or another key's entry (a raw value stored under the wrong key), a bad checksum, or an expired entry. CRC-32 and
not a cryptographic hash: it guards against torn writes and bit rot (zlib's runs at about 2 GB/s here, blake2b at
0.8), not against a writer with access to the store, which could write any valid entry anyway.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import time
import zlib
from collections.abc import Mapping

MAGIC = b"DSKV"
VERSION = 1
_FIELDS = struct.Struct("<4sHHQQ16s8s")  # everything the checksum covers besides the payload
_HEADER = struct.Struct("<4sHHQQ16s8sI")
HEADER_SIZE = _HEADER.size


class Refusal(enum.Enum):
    """Why `decode_entry` refused an entry. Every reason but EXPIRED is a corrupt entry."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad magic"
    VERSION = "unknown version"
    LENGTH = "payload length mismatch"
    NAMESPACE = "another namespace"
    KEY = "another key"
    CHECKSUM = "bad checksum"
    EXPIRED = "expired"


def fingerprint(parts: Mapping[str, object]) -> str:
    """A namespace for `parts` (model path or hash, dtype, block size, cache layout version, ...): 32 hex digits of
    blake2b over their canonical JSON, so equal configs share entries and any difference separates them. Values
    must be JSON-serialisable (str() is applied to the others)."""
    text = json.dumps(dict(parts), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def store_key(namespace: str, key: str) -> str:
    """The key in the store: `{namespace}/{kind}/{hash}` for the caller's `{kind}/{hash}`."""
    if not namespace or "/" in namespace:
        raise ValueError(f"namespace must be non-empty without '/', got {namespace!r}")
    if not key:
        raise ValueError("key must be non-empty")
    return f"{namespace}/{key}"


def _digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def encode_header(namespace: str, key: str, payload: bytes | memoryview, *, ttl_s: float | None = None,
                  now: float | None = None) -> bytes:
    """The header for `payload` under `key` (the caller's key, without the namespace); send it before the payload
    (a backend that takes parts avoids a copy of the payload)."""
    expires_ms = 0
    if ttl_s is not None and ttl_s > 0:
        expires_ms = int(((time.time() if now is None else now) + ttl_s) * 1000)
    fields = (MAGIC, VERSION, HEADER_SIZE, len(payload), expires_ms, _digest(namespace, 16),
              _digest(store_key(namespace, key), 8))
    return _HEADER.pack(*fields, zlib.crc32(payload, zlib.crc32(_FIELDS.pack(*fields))))


def encode(namespace: str, key: str, payload: bytes, *, ttl_s: float | None = None, now: float | None = None) -> bytes:
    """Header + payload in one bytes object."""
    return encode_header(namespace, key, payload, ttl_s=ttl_s, now=now) + payload


def decode_entry(raw: bytes | memoryview, namespace: str, key: str, *, now: float | None = None) -> tuple[bytes | None,
                                                                                              Refusal | None]:
    """(payload, None) for a valid entry of `namespace` / `key`, else (None, the reason)."""
    if len(raw) < HEADER_SIZE:
        return None, Refusal.TRUNCATED
    magic, version, header_size, length, expires_ms, ns_digest, key_digest, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        return None, Refusal.BAD_MAGIC
    if version != VERSION or header_size != HEADER_SIZE:
        return None, Refusal.VERSION
    if len(raw) != HEADER_SIZE + length:
        return None, Refusal.TRUNCATED if len(raw) < HEADER_SIZE + length else Refusal.LENGTH
    if ns_digest != _digest(namespace, 16):
        return None, Refusal.NAMESPACE
    if key_digest != _digest(store_key(namespace, key), 8):
        return None, Refusal.KEY
    payload = memoryview(raw)[HEADER_SIZE:]
    if zlib.crc32(payload, zlib.crc32(memoryview(raw)[:_FIELDS.size])) != crc:
        return None, Refusal.CHECKSUM
    if expires_ms and (time.time() if now is None else now) * 1000 >= expires_ms:
        return None, Refusal.EXPIRED
    return bytes(payload), None


def decode(raw: bytes | memoryview, namespace: str, key: str, *, now: float | None = None) -> bytes | None:
    """The payload of a valid, unexpired entry of `namespace` / `key`, else None."""
    return decode_entry(raw, namespace, key, now=now)[0]
