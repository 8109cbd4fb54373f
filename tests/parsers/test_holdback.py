"""Tests for deltaserve.parsers.holdback: text-marker scanning with hold-back, and id -> event decoding."""

from __future__ import annotations

import random

import pytest

from deltaserve.parsers.holdback import Special, TokenEvents, partial_marker_start, scan_markers
from deltaserve.text.tokenizer import Tokenizer
from tests.parsers.helpers import Bytes, build

MARKERS = {"</thinking>": "END", "</think>": "END_SHORT", "<|x|>": "X"}


def scan_all(pieces: list[str], markers: dict[str, str]) -> list[str | tuple[str]]:
    """Feed text pieces through scan_markers with hold-back; returns text runs and (marker,) items in order."""
    out: list[str | tuple[str]] = []
    held = ""
    for i, piece in enumerate([*pieces, ""]):
        text, final = held + piece, i == len(pieces)
        held = ""
        while text:
            cut, name, end = scan_markers(text, markers, final=final)
            if cut:
                out.append(text[:cut])
            if name is None:
                held = text[cut:]
                break
            out.append((name,))
            text = text[end:]
    merged: list[str | tuple[str]] = []
    for item in out:  # join adjacent text runs: only their concatenation is chunking-invariant
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


def test_partial_marker_start() -> None:
    """The longest suffix that is a proper prefix of a marker is found; a full marker is not 'partial'."""
    assert partial_marker_start("abc </thi", MARKERS) == 4
    assert partial_marker_start("abc <", MARKERS) == 4
    assert partial_marker_start("abc", MARKERS) == 3
    assert partial_marker_start("</think", MARKERS) == 0
    assert partial_marker_start("<|x|>", MARKERS) == 5


def test_scan_prefers_earliest_then_longest() -> None:
    """The earliest complete marker wins, the longest at a tie; a possible marker start is held unless final."""
    assert scan_markers("a</think>b", MARKERS, final=False) == (1, "END_SHORT", 9)
    assert scan_markers("a</thinking>b", MARKERS, final=False) == (1, "END", 12)
    assert scan_markers("a</think", MARKERS, final=False) == (1, None, 1)  # </think> or </thinking> may follow
    assert scan_markers("a</think", MARKERS, final=True) == (8, None, 8)
    nested = {"<|x|>": "X", "<|x|><|y|>": "XY"}  # a marker that is a prefix of another
    assert scan_markers("<|x|>", nested, final=False) == (0, None, 0)  # may still grow into <|x|><|y|>
    assert scan_markers("<|x|>", nested, final=True) == (0, "X", 5)
    assert scan_markers("<|x|><|x|>", nested, final=False) == (0, "X", 5)  # the second one is held next time
    assert scan_markers("<|x|><|y|>", nested, final=False) == (0, "XY", 10)
    assert scan_markers("a<|x|>b</think>", MARKERS, final=False) == (1, "X", 6)


@pytest.mark.parametrize("markers", [MARKERS, {"<|x|>": "X", "<|x|><|y|>": "XY", "|>": "END"}])
def test_scan_is_chunking_invariant(markers: dict[str, str]) -> None:
    """Any cut of the text into pieces yields the same markers and the same text between them."""
    rng = random.Random(3)
    alphabet = ["a", " ", "<", "/", "|", "x", "y", ">", "</think>", "</thinking>", "<|x|>", "<|y|>", "</thin", "ing>"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        expected = scan_all([text], markers)
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert scan_all(pieces, markers) == expected, (text, pieces)


def test_token_events_split_text_at_specials(k2_tok: Tokenizer) -> None:
    """Specials become events of their own; text between them is decoded whole."""
    ids = build(k2_tok, "ab</think>cd[EOS]")
    events = TokenEvents(k2_tok, k2_tok.all_special_ids).push(ids)
    end = k2_tok.special_tokens
    assert events == ["ab", Special(end["</think>"]), "cd", Special(end["[EOS]"])]


def test_token_events_hold_partial_characters(k2_tok: Tokenizer) -> None:
    """A multi-byte character split over ids comes out whole, in the push that completes it."""
    ids = build(k2_tok, Bytes("é😀"))
    events = TokenEvents(k2_tok, k2_tok.all_special_ids)
    out = [events.push([i]) for i in ids]
    assert out == [[], ["é"], [], [], [], ["😀"]]
    assert events.finish() == []


def test_token_events_flush_dangling_bytes(k2_tok: Tokenizer) -> None:
    """Dangling bytes decode to U+FFFD at a special token and at finish()."""
    first_byte = build(k2_tok, Bytes("é"))[:1]
    events = TokenEvents(k2_tok, k2_tok.all_special_ids)
    assert events.push(first_byte + build(k2_tok, "[EOS]")) == ["\ufffd", Special(k2_tok.special_tokens["[EOS]"])]
    assert events.push(first_byte) == []
    assert events.finish() == ["\ufffd"]


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_token_events_skip_out_of_vocab_ids(k2_tok: Tokenizer, bad: int) -> None:
    """Ids the tokenizer does not know (padded vocab rows) are skipped instead of raising."""
    events = TokenEvents(k2_tok, k2_tok.all_special_ids)
    assert events.push([*build(k2_tok, "a"), bad, *build(k2_tok, "b")]) == ["ab"]
