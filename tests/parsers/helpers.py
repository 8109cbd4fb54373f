"""Helpers for the parser tests: build output ids from marked-up text, stream them in chunks, reassemble deltas."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deltaserve.parsers.types import OutputParser, ParsedDelta, ParsedMessage, ToolCall
from deltaserve.text.tokenizer import Tokenizer, bytes_to_unicode

_SPECIAL_RE = re.compile(r"<\|[a-z_]+\|>|</?think>|\[[A-Z_a-z]+\]")


@dataclass(frozen=True)
class Plain:
    """Text encoded with special tokens disallowed: marker-like characters in it stay data."""

    text: str


@dataclass(frozen=True)
class Bytes:
    """Text encoded as one byte-level token per UTF-8 byte, so a character spans several ids."""

    text: str


def build(tok: Tokenizer, *parts: str | Plain | Bytes) -> list[int]:
    """Output ids: in a `str` part, each special-token name of `tok` becomes its id and the rest is plain text."""
    specials = tok.special_tokens
    ids: list[int] = []
    for part in parts:
        if isinstance(part, Plain):
            ids += tok.encode(part.text, allow_special=False)
        elif isinstance(part, Bytes):
            spelling = bytes_to_unicode()
            ids += [tok.token_to_id(spelling[b]) for b in part.text.encode()]
        else:
            pos = 0
            for m in _SPECIAL_RE.finditer(part):
                if m[0] in specials:
                    ids += tok.encode(part[pos : m.start()], allow_special=False) if m.start() > pos else []
                    ids.append(specials[m[0]])
                    pos = m.end()
            ids += tok.encode(part[pos:], allow_special=False) if pos < len(part) else []
    return ids


@dataclass
class Streamed:
    """Concatenation of every delta of one run."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)
    deltas: list[ParsedDelta] = field(default_factory=list)

    def add(self, delta: ParsedDelta) -> None:
        self.deltas.append(delta)
        self.reasoning += delta.reasoning
        self.content += delta.content
        for tc in delta.tool_calls:
            if tc.index == len(self.calls):
                assert tc.id is not None and tc.name is not None, f"first delta of call {tc.index} lacks id/name"
                self.calls.append({"id": tc.id, "name": tc.name, "arguments": ""})
            else:
                assert tc.index < len(self.calls), f"call index {tc.index} skips ahead"
                assert tc.id is None and tc.name is None, f"call {tc.index} got its id/name twice"
            self.calls[tc.index]["arguments"] += tc.arguments

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(**c) for c in self.calls)


def run(parser: OutputParser, chunks: Iterable[Sequence[int]]) -> Streamed:
    """Push every chunk, then finish; collect the deltas."""
    out = Streamed()
    for chunk in chunks:
        out.add(parser.push(chunk))
    out.add(parser.finish())
    return out


def parse(cls: type[OutputParser], tok: Tokenizer, ids: Sequence[int], **kw: bool) -> ParsedMessage:
    """One-shot parse: all ids in one push, then finish."""
    parser = cls(tok, **kw)
    parser.push(ids)
    parser.finish()
    return parser.message


def assert_deltas_match_message(streamed: Streamed, message: ParsedMessage) -> None:
    """The concatenated deltas are exactly the message (no text lost, duplicated or leaked)."""
    assert streamed.reasoning == (message.reasoning or "")
    assert streamed.content == message.content
    assert streamed.tool_calls() == message.tool_calls


def assert_no_marker_text(streamed: Streamed, forbidden: Sequence[str]) -> None:
    """No delta of any channel holds any of `forbidden` (marker spellings or their fragments)."""
    for delta in streamed.deltas:
        pieces = [delta.reasoning, delta.content, *(tc.arguments for tc in delta.tool_calls)]
        for piece in pieces:
            for bad in forbidden:
                assert bad not in piece, f"{bad!r} leaked into delta {delta!r}"


def assert_chunking_invariant(
    cls: type[OutputParser],
    tok: Tokenizer,
    ids: Sequence[int],
    chunkings: Iterable[Sequence[Sequence[int]]],
    *,
    forbidden: Sequence[str] = (),
    **kw: bool,
) -> ParsedMessage:
    """Every chunking streams the one-shot message, with no forbidden text in any delta; returns that message."""
    expected = parse(cls, tok, ids, **kw)
    for chunks in chunkings:
        parser = cls(tok, **kw)
        streamed = run(parser, chunks)
        assert parser.message == expected, f"chunking {[len(c) for c in chunks]}"
        assert_deltas_match_message(streamed, expected)
        assert_no_marker_text(streamed, forbidden)
    return expected


def two_cut_chunkings(ids: Sequence[int]) -> list[list[list[int]]]:
    """Every way of cutting `ids` into two pushes (an empty first or last push included)."""
    return [[list(ids[:k]), list(ids[k:])] for k in range(len(ids) + 1)]


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def random_chunkings(ids: Sequence[int], rng: random.Random, count: int) -> list[list[list[int]]]:
    """`count` random chunkings: cut points drawn with a random density, empty pushes allowed."""
    out = []
    for _ in range(count):
        density = rng.choice((0.05, 0.2, 0.5, 0.9))
        chunks: list[list[int]] = [[]]
        for i in ids:
            if rng.random() < density:
                chunks.append([])
            chunks[-1].append(i)
        if rng.random() < 0.2:
            chunks.insert(rng.randrange(len(chunks) + 1), [])
        out.append(chunks)
    return out
