"""The entry format: header + payload, refused when truncated, altered, another namespace's or key's, or expired."""

from __future__ import annotations

import pytest

from deltaserve.kvstore.entry import HEADER_SIZE, Refusal, decode, decode_entry, encode, fingerprint, store_key

NS = fingerprint({"model": "tiny", "dtype": "float32", "block_size": 16})


def test_round_trip_and_header_size() -> None:
    raw = encode(NS, "kv/abc", b"payload")
    assert len(raw) == HEADER_SIZE + len(b"payload")
    assert decode(raw, NS, "kv/abc") == b"payload"
    assert decode(encode(NS, "kv/empty", b""), NS, "kv/empty") == b""


@pytest.mark.parametrize("cut", [0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5])
def test_truncated_is_refused(cut: int) -> None:
    raw = encode(NS, "kv/k", b"0123456789")
    assert decode_entry(raw[:cut], NS, "kv/k") == (None, Refusal.TRUNCATED)


def test_every_flipped_byte_is_refused() -> None:
    raw = encode(NS, "kv/k", bytes(range(40)))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        payload, refusal = decode_entry(bytes(bad), NS, "kv/k")
        assert payload is None and refusal is not None, f"byte {i} flipped was accepted"


def test_other_namespace_or_key_or_extra_bytes_refused() -> None:
    raw = encode(NS, "kv/k", b"v")
    other = fingerprint({"model": "other", "dtype": "float32", "block_size": 16})
    assert decode_entry(raw, other, "kv/k") == (None, Refusal.NAMESPACE)
    assert decode_entry(raw, NS, "kv/other") == (None, Refusal.KEY)
    assert decode_entry(raw + b"x", NS, "kv/k") == (None, Refusal.LENGTH)
    assert decode_entry(b"XXXX" + raw[4:], NS, "kv/k") == (None, Refusal.BAD_MAGIC)


def test_expiry() -> None:
    raw = encode(NS, "kv/k", b"v", ttl_s=10.0, now=1000.0)
    assert decode(raw, NS, "kv/k", now=1009.0) == b"v"
    assert decode_entry(raw, NS, "kv/k", now=1010.0) == (None, Refusal.EXPIRED)
    assert decode(encode(NS, "kv/k", b"v", ttl_s=None, now=0.0), NS, "kv/k") == b"v"  # never expires


def test_fingerprint_is_canonical_and_separating() -> None:
    assert fingerprint({"a": 1, "b": "x"}) == fingerprint({"b": "x", "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert len(NS) == 32 and "/" not in NS


def test_store_key() -> None:
    assert store_key(NS, "kv/123") == f"{NS}/kv/123"
    with pytest.raises(ValueError):
        store_key("a/b", "kv/1")
    with pytest.raises(ValueError):
        store_key("", "kv/1")
