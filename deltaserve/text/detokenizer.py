"""Incremental detokenisation of one output sequence: UTF-8-safe streamed text, stop strings and their hold-back.

Follows vLLM's output text, stop-string trimming and `min_tokens` rule; each push costs O(new tokens).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one `IncrementalDetokenizer.push` produced."""

    text_delta: str
    """New text safe to show now; "" while bytes of a partial character or a possible stop-string start are held."""
    stop_string: str | None
    """The stop string that ended generation in this push, else None."""


class IncrementalDetokenizer:
    """Turns generated token ids, pushed as they come, into streamed text; one instance per output sequence.

    Contracts:
    - Bytes of a character split across tokens are held until it completes, so no U+FFFD appears for an incomplete
      tail mid-stream; invalid bytes decode to U+FFFD exactly as `Tokenizer.decode` of all ids would.
    - A stop string must end in text produced by a token after the first `min_tokens` ids (vLLM's rule), but may start
      earlier. The earliest-starting match in a push wins (ties: the first in `stop`). The text is cut right before
      it, or right after it with `include_stop_str_in_output`.
    - Without `include_stop_str_in_output`, the longest suffix of the text that is a proper prefix of a stop string is
      held back from `text_delta` until resolved. With it nothing needs holding: a match always ends after any text
      already shown.
    - Joined `text_delta`s (plus `finish()`'s return) equal `text`. After a stop, or after `finish()`, `push` raises.

    Not thread-safe; the owner (the output processor of one request) calls it from one thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {stop!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stops
        self._include_stop = include_stop_str_in_output
        self._hold_stops = () if include_stop_str_in_output else stops
        self._min_tokens = min_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lookback_chars = max((len(s) for s in stops), default=1) - 1  # a match may start this far back
        self._lookback = ""  # last `_lookback_chars` decoded chars, shown or not
        self._held = ""  # decoded but not yet shown: a possible stop-string start
        self._emitted: list[str] = []  # text_delta chunks; joined lazily by `text`
        self._num_tokens = 0
        self._stopped = False
        self._finished = False

    @property
    def text(self) -> str:
        """All text handed out so far (every `text_delta`, then `finish()`'s flush); after a stop, the final text."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string has ended generation."""
        return self._stopped

    def push(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Append newly generated ids (one or several); return the text now safe to show and any stop string hit.

        Raises RuntimeError after a stop or `finish()`, ValueError for an id outside the vocabulary (state unchanged).
        """
        if self._stopped or self._finished:
            raise RuntimeError("push() after the sequence " + ("stopped" if self._stopped else "was finished"))
        ids = list(token_ids)
        # Text of the first `min_tokens` ids is never searched as new text, only as look-back (vLLM, PR 22014).
        num_unchecked = min(len(ids), max(0, self._min_tokens - self._num_tokens))
        raw_unchecked = self._raw(ids[:num_unchecked])  # both decoded before the decoder is fed: a bad id
        raw_checked = self._raw(ids[num_unchecked:])  # raises with the state untouched
        self._num_tokens += len(ids)
        unchecked = self._decoder.decode(raw_unchecked)
        checked = self._decoder.decode(raw_checked)

        window = self._lookback + unchecked + checked
        pending = self._held + unchecked + checked  # window and pending end at the same char
        match = self._find_stop(window, len(window) - len(checked)) if checked else None
        if match is not None:
            stop_string, cut = match
            delta = pending[: len(pending) - (len(window) - cut)]
            self._stopped, self._held = True, ""
            self._emit(delta)
            return DetokenizerUpdate(delta, stop_string)

        num_held = self._held_suffix_len(pending)
        delta, self._held = pending[: len(pending) - num_held], pending[len(pending) - num_held :]
        self._lookback = window[max(0, len(window) - self._lookback_chars) :]
        self._emit(delta)
        return DetokenizerUpdate(delta, None)

    def finish(self) -> str:
        """End of generation without a stop string: flush and return held text (a partial character -> U+FFFD).

        Returns "" after a stop or a previous `finish()`.
        """
        if self._stopped or self._finished:
            return ""
        self._finished = True
        tail = self._held + self._decoder.decode(b"", final=True)
        self._held = self._lookback = ""
        self._emit(tail)
        return tail

    def _raw(self, ids: list[int]) -> bytes:
        if not ids:
            return b""
        return self._tokenizer.decode_bytes(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, text: str) -> None:
        if text:
            self._emitted.append(text)

    def _find_stop(self, window: str, new_start: int) -> tuple[str, int] | None:
        """(stop string, cut index in `window`) of the earliest match that ends at or after `window[new_start]`."""
        best: tuple[str, int] | None = None
        for stop in self._stop:
            start = window.find(stop, max(0, new_start - len(stop) + 1))
            if start != -1 and (best is None or start < best[1]):
                best = (stop, start)
        if best is None:
            return None
        stop, start = best
        return stop, start + len(stop) if self._include_stop else start

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string (0 if none)."""
        best = 0
        for stop in self._hold_stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
