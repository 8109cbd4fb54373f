"""Stop strings over a stream of text pieces (the chat content channel), with vLLM's cut and hold-back rules."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    """Cuts a text stream before (or, with `include`, after) the first stop string; holds back a possible start.

    `push` returns (text safe to show, matched stop string or None); after a match everything else is dropped.
    Joined outputs plus `flush()` equal the filtered text.
    """

    def __init__(self, stop: Sequence[str], *, include: bool = False) -> None:
        self._stops = tuple(s for s in stop if s)
        self._include = include
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None or not text:
            return "", None
        if not self._stops:
            return text, None
        pending = self._held + text
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = pending.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.matched, self._held = stop, ""
            return pending[: at + len(stop) if self._include else at], stop
        hold = self._held_suffix_len(pending)  # held in both modes so a match can span pushes
        self._held = pending[len(pending) - hold:] if hold else ""
        return pending[: len(pending) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _held_suffix_len(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
