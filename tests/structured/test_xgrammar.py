"""The optional xgrammar backend behind the same interface; skipped where `xgrammar` is not installed (it is not a
dependency: it pulls a CUDA build of torch)."""

from __future__ import annotations

import json
import re

import pytest

from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured import allocate_bitmask, allowed_token_ids, make_backend
from deltaserve.text.tiny_tokenizer import TINY_SPECIAL_TOKENS, write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer

pytest.importorskip("xgrammar")

VOCAB = 1024
EOS = VOCAB - len(TINY_SPECIAL_TOKENS) + TINY_SPECIAL_TOKENS.index("[EOS]")
STOPS = frozenset({EOS})


@pytest.fixture(scope="module", params=["tokenizers", "tiktoken"])
def tok(request, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp(f"xgr-{request.param}")
    write_tiny_tokenizer(path, VOCAB, fmt=request.param)
    return Tokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def backend(tok):
    return make_backend("xgrammar", tok)


def mask(grammar) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    return set(allowed_token_ids(bitmask[0], VOCAB))


def walk(grammar, limit: int = 80) -> list[int]:
    """Take the lowest allowed non-stop token until only stop tokens are allowed."""
    ids = []
    while (allowed := mask(grammar)) - STOPS:
        token = min(allowed - STOPS)
        assert grammar.accept_token(token)
        ids.append(token)
        assert len(ids) < limit
    return ids


def test_json_schema_walk_validates(tok, backend):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "c": {"enum": ["on", "off"]}},
              "required": ["n", "c"], "additionalProperties": False}
    grammar = backend.compile(StructuredOutput("json_schema", json.dumps(schema)), STOPS)
    jsonschema.validate(json.loads(tok.decode(walk(grammar))), schema)
    assert grammar.accept_token(EOS) and grammar.is_terminated()
    assert mask(grammar) == set(STOPS)


def test_regex_and_json_object(tok, backend):
    grammar = backend.compile(StructuredOutput("regex", "[a-c]{2}-[0-9]"), STOPS)
    assert re.fullmatch("[a-c]{2}-[0-9]", tok.decode(walk(grammar)))
    obj = backend.compile(StructuredOutput("json_object"), STOPS)
    assert all(tok.decode_bytes([t]).startswith((b"{", b" ", b"\n", b"\t")) for t in mask(obj))


def test_special_tokens_never_allowed_in_text(tok, backend):
    grammar = backend.compile(StructuredOutput("regex", "(.|\n)+"), STOPS)
    assert not mask(grammar) & set(tok.special_tokens.values())


def test_rollback(tok, backend):
    grammar = backend.compile(StructuredOutput("regex", "[a-c]{1,3}"), STOPS)
    grammar.accept_token(tok.encode("a")[0])
    after_one = mask(grammar)
    grammar.accept_token(tok.encode("b")[0])
    grammar.rollback(1)
    assert mask(grammar) == after_one


@pytest.mark.parametrize(("kind", "spec"), [("json_schema", "{not json"), ("regex", "(ab"),
                                            ("lark", 'start: "a"')])
def test_invalid_specs(backend, kind, spec):
    with pytest.raises(ValueError, match=f"structured {kind}|lark"):
        backend.validate(StructuredOutput(kind, spec))
    with pytest.raises(ValueError):
        backend.compile(StructuredOutput(kind, spec), STOPS)
