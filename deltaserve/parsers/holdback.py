"""Shared streaming helpers for the output parsers: generated ids -> text / special-token events (UTF-8 safe), and
the hold-back of a possibly partial text marker at the tail of the text seen so far.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deltaserve.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Special:
    """A special token in the output, kept as an event of its own (never decoded into text)."""

    token_id: int


Event = str | Special
"""One step of the decoded output: a run of text, or a special token."""


class TokenEvents:
    """Incremental decoder of one output sequence's ids into `Event`s.

    Contracts:
    - Ids in `special_ids` become `Special` events; every other id is decoded to UTF-8 text.
    - Bytes of a character split across ids are held until it completes, so no U+FFFD appears for an incomplete tail
      mid-stream. A special token ends a text run: dangling bytes before it decode to U+FFFD, as
      `Tokenizer.decode` of all ids would (the special token's text sits between them there).
    - Ids outside the tokenizer's vocabulary (a model's padded vocab rows) are skipped.
    - Chunk-invariant: the concatenated text between two specials does not depend on how the ids were pushed.
    """

    def __init__(self, tokenizer: Tokenizer, special_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._special_ids = frozenset(special_ids)
        self._vocab_size = tokenizer.vocab_size
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> list[Event]:
        """Decode newly generated ids; text of a partial trailing character is held for the next push."""
        events: list[Event] = []
        run: list[int] = []
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_size:
                continue
            if token_id in self._special_ids:
                self._append_text(events, run, final=True)
                run = []
                events.append(Special(token_id))
            else:
                run.append(token_id)
        self._append_text(events, run, final=False)
        return events

    def finish(self) -> list[Event]:
        """End of output: a partial trailing character decodes to U+FFFD."""
        events: list[Event] = []
        self._append_text(events, [], final=True)
        return events

    def _append_text(self, events: list[Event], run: list[int], *, final: bool) -> None:
        raw = self._tokenizer.decode_bytes(run) if run else b""
        text = self._decoder.decode(raw, final=final)
        if final:
            self._decoder.reset()
        if text:
            events.append(text)


def partial_marker_start(text: str, markers: Iterable[str]) -> int:
    """Start of the longest suffix of `text` that is a proper prefix of one of `markers` (`len(text)` if none)."""
    start = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if len(text) - k >= start:
                break
            if text.endswith(marker[:k]):
                start = len(text) - k
                break
    return start


def scan_markers(text: str, markers: Mapping[str, str], *, final: bool) -> tuple[int, str | None, int]:
    """Find the first text marker in `text` that no later text can change.

    Args:
        text: the text not yet consumed (held text first).
        markers: marker spelling -> the name the parser dispatches on.
        final: no more text can follow (a special token or the end of output comes next): nothing is held.

    Returns:
        (cut, name, end). With a name, `text[:cut]` precedes the marker `text[cut:end]`. Without one, `text[:cut]`
        is safe to hand on and `text[cut:]` must be held (a possible partial marker; `cut == len(text)` when final).
        The earliest match wins, then the longest; a match that a longer marker could still extend is held, so the
        result does not depend on where the text was cut into pieces.
    """
    hold = len(text) if final else partial_marker_start(text, markers)
    best: tuple[int, str] | None = None
    for spelling in markers:
        pos = text.find(spelling, 0, hold + len(spelling) - 1)
        if pos == -1 or pos >= hold:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(spelling) > len(best[1])):
            best = (pos, spelling)
    if best is None:
        return hold, None, hold
    pos, spelling = best
    return pos, markers[spelling], pos + len(spelling)


def marker_table(tokenizer: Tokenizer, names: Sequence[str]) -> tuple[dict[int, str], list[str]]:
    """Split marker names into those that are whole tokens of `tokenizer` (by id) and those only spelled as text."""
    specials = tokenizer.special_tokens
    by_id = {specials[name]: name for name in names if name in specials}
    as_text = [name for name in names if name not in specials]
    return by_id, as_text
