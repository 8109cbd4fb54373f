"""StopStringFilter: the cut is the same however the text is chunked; a possible stop start is never shown."""

from __future__ import annotations

import random

import pytest

from deltaserve.text.stop_strings import StopStringFilter


def _run(pieces, stops, include=False):
    f = StopStringFilter(stops, include=include)
    shown, matched = [], None
    for p in pieces:
        text, stop = f.push(p)
        shown.append(text)
        matched = matched or stop
    shown.append(f.flush())
    return "".join(shown), matched, shown


@pytest.mark.parametrize("include", [False, True])
def test_every_chunking_gives_the_same_cut(include):
    text = "alpha beta ENDgamma END delta"
    whole, stop, _ = _run([text], ["END", "ta EN"], include)
    assert stop == "ta EN"  # the earliest-starting match wins
    assert whole == ("alpha be" + ("ta EN" if include else ""))
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        got, got_stop, shown = _run(pieces, ["END", "ta EN"], include)
        assert (got, got_stop) == (whole, stop)
        if not include:
            assert all("EN" not in s and "ta E" not in s for s in shown)


def test_no_match_flushes_the_held_tail():
    got, stop, shown = _run(["abc E", "N"], ["END"])
    assert (got, stop) == ("abc EN", None)
    assert shown[:2] == ["abc ", ""]


def test_no_stops_passes_through():
    f = StopStringFilter([])
    assert f.push("x") == ("x", None) and f.flush() == ""
