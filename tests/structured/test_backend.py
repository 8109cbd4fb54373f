"""The llguidance backend on the tiny tokenizer (both file formats): masks allow exactly the grammar-legal tokens,
special tokens only where a grammar names them, the request's stop tokens once the text is complete; validate()
rejects broken schemas, regexes and grammars with a clear ValueError."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured import allocate_bitmask, allowed_token_ids, make_backend
from deltaserve.structured.backend import set_allowed
from deltaserve.text.tiny_tokenizer import TINY_SPECIAL_TOKENS, write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer

VOCAB = 1024
MODEL_VOCAB = 1056  # wider logits than the tokenizer, as padded LM heads are


@pytest.fixture(scope="module", params=["tokenizers", "tiktoken"])
def tok(request, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp(f"tok-{request.param}")
    write_tiny_tokenizer(path, VOCAB, fmt=request.param)
    tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.kind == request.param
    return tokenizer


@pytest.fixture(scope="module")
def backend(tok):
    return make_backend("llguidance", tok, MODEL_VOCAB)


def special(tok: Tokenizer, name: str) -> int:
    return tok.special_tokens[name]


def mask(grammar) -> set[int]:
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    return set(allowed_token_ids(bitmask[0], MODEL_VOCAB))


def feed(grammar, tok: Tokenizer, text: str) -> None:
    for t in tok.encode(text, allow_special=False):
        assert grammar.accept_token(t), f"grammar rejected {tok.decode_bytes([t])!r}"


def oracle(tok: Tokenizer, language: set[str], prefix: str) -> set[int]:
    """Ids whose bytes extend `prefix` to a prefix of some string of the (finite) language."""
    words = {w.encode() for w in language}
    done = prefix.encode()
    ids = set()
    for i in range(tok.vocab_size):
        if i in tok.all_special_ids or i in tok.special_tokens.values():
            continue
        piece = tok.decode_bytes([i])
        if piece and any(w.startswith(done + piece) for w in words):
            ids.add(i)
    return ids


EOS = VOCAB - len(TINY_SPECIAL_TOKENS) + TINY_SPECIAL_TOKENS.index("[EOS]")  # the specials take the last ids
STOPS = frozenset({EOS})


def test_stop_id_is_eos(tok):
    assert special(tok, "[EOS]") == EOS


@pytest.mark.parametrize("prefix", ["", "a", "ab", "x"])
def test_regex_mask_is_exactly_the_legal_tokens(tok, backend, prefix):
    """`[a-c]{1,3}|x[0-9]`: the mask after each prefix equals the byte-level oracle (+ the stop token where the text
    may end); no branch point here is forced, so no canonical-tokenization pruning applies."""
    language = {"".join(p) for n in (1, 2, 3) for p in itertools.product("abc", repeat=n)}
    language |= {f"x{d}" for d in range(10)}
    grammar = backend.compile(StructuredOutput("regex", "[a-c]{1,3}|x[0-9]"), STOPS)
    for ch in prefix:  # one byte at a time: single bytes are tokens of a byte-level BPE
        assert grammar.accept_token(tok.encode(ch)[0])
    expected = oracle(tok, language, prefix)
    if prefix in language:
        expected |= STOPS
    assert mask(grammar) == expected
    assert not grammar.is_terminated()


def test_json_schema_enum_masks(tok, backend):
    """A schema whose values diverge at once: the first mask is exactly the oracle's; after a forced stretch the
    mask stays inside the oracle; the finished value allows only the stop token."""
    schema = {"enum": ["red", "green", 7, 81]}
    language = {'"red"', '"green"', "7", "81"}
    grammar = backend.compile(StructuredOutput("json_schema", json.dumps(schema)), STOPS)
    assert mask(grammar) == oracle(tok, language, "")
    assert grammar.accept_token(tok.encode('"')[0])
    assert mask(grammar) == oracle(tok, language, '"')
    assert grammar.accept_token(tok.encode("r")[0])
    allowed = mask(grammar)  # 'ed"' is forced: llguidance keeps only its canonical tokenization
    assert allowed and allowed <= oracle(tok, language, '"r')
    feed(grammar, tok, 'ed"')
    assert mask(grammar) == set(STOPS)
    assert grammar.is_terminated()
    assert grammar.accept_token(EOS)


def test_json_schema_object_generation_validates(tok, backend):
    """Walking the mask greedily (lowest allowed id each step) produces JSON that satisfies the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "c": {"enum": ["on", "off"]}},
              "required": ["n", "c"], "additionalProperties": False}
    grammar = backend.compile(StructuredOutput("json_schema", json.dumps(schema)), STOPS)
    ids = []
    while (allowed := mask(grammar)) != set(STOPS):
        token = min(allowed - STOPS)
        assert grammar.accept_token(token)
        ids.append(token)
        assert len(ids) < 50
    jsonschema.validate(json.loads(tok.decode(ids)), schema)


def test_json_object(tok, backend):
    grammar = backend.compile(StructuredOutput("json_object"), STOPS)
    first = mask(grammar)
    assert first and all(tok.decode_bytes([i]).startswith(b"{") for i in first)
    feed(grammar, tok, "{")
    allowed = {tok.decode_bytes([i]) for i in mask(grammar)}
    assert b"}" in allowed and b'"' in allowed
    assert not allowed & {b" ", b"a", b"{", b"]"}  # fixed whitespace: none after "{"
    feed(grammar, tok, '"k": [1, true, null]}')  # json.dumps separators
    assert mask(grammar) == set(STOPS)


def test_lark_grammar_names_special_tokens(tok, backend):
    """A Lark grammar may emit a special token by name; it is allowed exactly there, and the stop token after."""
    middle = special(tok, "<|im_middle|>")
    grammar = backend.compile(StructuredOutput("lark", 'start: ("yes" | "no") <|im_middle|> "ok"'), STOPS)
    assert middle not in mask(grammar)
    feed(grammar, tok, "yes")
    assert mask(grammar) == {middle}
    assert grammar.accept_token(middle)
    feed(grammar, tok, "ok")
    assert mask(grammar) == set(STOPS)


def test_special_tokens_and_padding_never_leak_into_text(tok, backend):
    """Free text (`.+`) never allows a special token, nor an id past the tokenizer (the logits' padding)."""
    grammar = backend.compile(StructuredOutput("regex", "(.|\n)+"), STOPS)
    allowed = mask(grammar)
    assert len(allowed) > 500
    assert not allowed & set(tok.special_tokens.values())
    assert max(allowed) < VOCAB


def test_stop_token_set_is_per_request(tok, backend):
    """A complete text allows exactly the request's stop tokens; an empty set falls back to the tokenizer's eos."""
    both = frozenset({EOS, special(tok, "<|im_end|>")})
    grammar = backend.compile(StructuredOutput("regex", "ok"), both)
    feed(grammar, tok, "ok")
    assert mask(grammar) == set(both)
    fallback = backend.compile(StructuredOutput("regex", "ok"), frozenset())
    feed(fallback, tok, "ok")
    assert mask(fallback) == set(tok.eos_token_ids)


def test_rollback_restores_the_mask(tok, backend):
    grammar = backend.compile(StructuredOutput("regex", "[a-c]{1,3}|x[0-9]"), STOPS)
    grammar.accept_token(tok.encode("a")[0])
    after_one = mask(grammar)
    grammar.accept_token(tok.encode("b")[0])
    assert mask(grammar) != after_one
    grammar.rollback(1)
    assert mask(grammar) == after_one


def test_rejected_token(tok, backend):
    grammar = backend.compile(StructuredOutput("regex", "[a-c]+"), STOPS)
    assert not grammar.accept_token(tok.encode("x")[0])


BROKEN = [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', "foo"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}', "minimum"),
    ("json_schema", '{"properties": {"a": {"$ref": "#/defs/missing"}}}', "missing"),
    ("regex", "(ab", "unclosed group"),
    ("lark", "start: foo", "foo"),
    ("lark", 'start: "a" (', "Expected"),
    ("lark", 'start: "a" <|no_such_token|>', "no_such_token"),
]


@pytest.mark.parametrize(("kind", "spec", "words"), BROKEN)
def test_validate_and_compile_reject_broken_specs(backend, kind, spec, words):
    structured = StructuredOutput(kind, spec)
    with pytest.raises(ValueError, match=f"structured {kind}") as info:
        backend.validate(structured)
    assert words in str(info.value)
    with pytest.raises(ValueError, match=f"structured {kind}"):
        backend.compile(structured, STOPS)


def test_validate_rejects_a_grammar_that_allows_no_first_token(backend):
    """`{"$ref": "#"}` compiles but matches nothing: the request would end empty with a 200; validate says so."""
    with pytest.raises(ValueError, match="structured json_schema"):
        backend.validate(StructuredOutput("json_schema", '{"$ref": "#"}'))


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}'),
    StructuredOutput("json_object"),
    StructuredOutput("regex", "[0-9]{3}-[a-z]+"),
    StructuredOutput("lark", 'start: "x" <|im_end|>'),
])
def test_validate_accepts_valid_specs(backend, structured):
    backend.validate(structured)


def test_unknown_and_missing_backends(tok):
    with pytest.raises(ValueError, match="not supported"):
        make_backend("outlines", tok)
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="not installed"):
            make_backend("xgrammar", tok)


def test_set_allowed_round_trips_high_bits():
    bitmask = allocate_bitmask(2, 70)
    set_allowed(bitmask, 1, [0, 31, 32, 63, 69])
    assert allowed_token_ids(bitmask[1], 70) == [0, 31, 32, 63, 69]
    assert allowed_token_ids(bitmask[0], 70) == list(range(70))
    assert bitmask.dtype == torch.int32
