"""`parse_json_object` decodes with msgspec first and falls back to json: the values it returns are json's, and a
body msgspec refuses gets json's reading (accepted or refused as before), so the faster path changes nothing."""

from __future__ import annotations

import json

import pytest

from deltaserve.entrypoints.server.errors import ApiError
from deltaserve.entrypoints.server.json_body import parse_json_object

ACCEPTED = [
    b'{"a": 1, "b": [1.5, -0.0, 1e-400, 123456789012345678901234567890, "x\\u00e9\\ud83d\\ude00"], "c": null}',
    b'\xef\xbb\xbf{"bom": true}',
    b'{"dup": 1, "dup": 2}',
    b'{"big": 1e400}',  # msgspec refuses it (out of a float's range); json reads inf, as before
    '{"text": "caf\u00e9 中文 😀", "nested": {"deep": [[[{}]]]}}'.encode(),
    b' {"spaces": "around"} \n',
]
REFUSED = [
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"a": "\\udc00x"}', "lone UTF-16 surrogate"),
    (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
    (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),
    (b'{"a": "\xff"}', "not UTF-8"),
    (b'{"a": ' + b"9" * 5000 + b"}", "malformed JSON body"),
    (b'{"a": 1} x', "malformed JSON body: Extra data"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}", "nests deeper than 128"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON body"),
]


@pytest.mark.parametrize("raw", ACCEPTED)
def test_accepted_bodies_read_as_json_reads_them(raw: bytes) -> None:
    data = parse_json_object(raw)
    assert data == json.loads(raw.decode("utf-8-sig"))
    assert json.dumps(data) == json.dumps(json.loads(raw.decode("utf-8-sig")))  # -0.0 and inf, not just ==


@pytest.mark.parametrize(("raw", "message"), REFUSED)
def test_refused_bodies_get_the_json_errors(raw: bytes, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_object(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert message in str(info.value)
