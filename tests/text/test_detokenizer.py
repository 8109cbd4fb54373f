"""Tests for deltaserve.text.detokenizer: UTF-8-safe streaming, special tokens, stop strings and their hold-back."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from deltaserve.text.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer, bytes_to_unicode

VOCAB = 1024
FORMATS = ("tokenizers", "tiktoken")
TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 2024, we're here!",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\tprint({'k': [1, 2, 3]})\n",
    "é中文🙂 combos: café 中文字符 🙂🎉 👩‍👩‍👧 naïve ΑΒΓ, emoji🚀end",
)
_ALPHABET = "abcxyz ABC 0123 .,!?\n\t é ü ß 中 文 日 🙂 🎉 🚀 Ω ж"
FUZZ_CASES = 200


@pytest.fixture(scope="module", params=FORMATS)
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp(f"tok_{request.param}")
    write_tiny_tokenizer(out, VOCAB, fmt=request.param)
    return Tokenizer.from_pretrained(out)


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text` (byte-level BPE keeps all 256 byte tokens)."""
    spelling = bytes_to_unicode()
    return [tok.token_to_id(spelling[b]) for b in text.encode()]


def char_ids(tok: Tokenizer, text: str) -> list[list[int]]:
    """One push per character of `text`, so each push adds exactly that character."""
    return [tok.encode(c) for c in text]


def run(det: IncrementalDetokenizer, groups: Sequence[Sequence[int]]) -> list[DetokenizerUpdate]:
    """Push `groups` in order until a stop; the updates received."""
    updates = []
    for group in groups:
        updates.append(det.push(group))
        if det.stopped:
            break
    return updates


def deltas(updates: Sequence[DetokenizerUpdate]) -> str:
    return "".join(u.text_delta for u in updates)


def random_groups(ids: list[int], rng: random.Random) -> list[list[int]]:
    groups, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        groups.append(ids[i : i + n])
        i += n
    return groups


def assert_streams_full_decode(tok: Tokenizer, groups: list[list[int]], *, skip: bool = True) -> None:
    """Joined deltas + finish() == decode(all ids), and no U+FFFD appears before finish() for valid text."""
    ids = [i for g in groups for i in g]
    expected = tok.decode(ids, skip_special_tokens=skip)
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    updates = run(det, groups)
    assert all(u.stop_string is None for u in updates)
    if "\ufffd" not in expected:
        assert "\ufffd" not in deltas(updates)
    assert deltas(updates) + det.finish() == expected == det.text


def test_token_by_token_matches_full_decode(tok: Tokenizer) -> None:
    """Pushing one id at a time streams exactly decode(all ids), with no U+FFFD mid-stream."""
    for text in TEXTS:
        ids = tok.encode(text)
        assert_streams_full_decode(tok, [[i] for i in ids])
        assert tok.decode(ids) == text


def test_random_groups_match_full_decode(tok: Tokenizer) -> None:
    """Fuzz: random strings pushed in random-size id groups stream exactly the original text."""
    rng = random.Random(0)
    for _ in range(FUZZ_CASES):
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert_streams_full_decode(tok, random_groups(ids, rng))


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_random_ids_match_full_decode(tok: Tokenizer, skip: bool) -> None:
    """Fuzz: arbitrary ids (invalid UTF-8 byte runs, specials) stream exactly what a full decode gives."""
    rng = random.Random(1)
    for _ in range(FUZZ_CASES):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        assert_streams_full_decode(tok, random_groups(ids, rng), skip=skip)


def test_split_multibyte_char_is_held_until_complete(tok: Tokenizer) -> None:
    """A character split across tokens yields "" until its last byte arrives, then the whole character."""
    det = IncrementalDetokenizer(tok)
    assert [det.push([i]).text_delta for i in byte_ids(tok, "a🙂")] == ["a", "", "", "", "🙂"]
    # The tiny BPE itself splits the emoji's bytes across tokens.
    ids = tok.encode("🙂")
    assert len(ids) > 1
    det = IncrementalDetokenizer(tok)
    assert [det.push([i]).text_delta for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert det.text == "🙂"


def test_special_tokens_dropped_or_kept(tok: Tokenizer) -> None:
    """skip_special_tokens=True drops special tokens from the text; False spells them out."""
    specials = tok.special_tokens
    ids = [specials["[BOS]"], *tok.encode("Hello"), specials["<think>"], *tok.encode(" world"), specials["<|im_end|>"]]
    for skip, expected in ((True, "Hello world"), (False, "[BOS]Hello<think> world<|im_end|>")):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        updates = run(det, [[i] for i in ids])
        assert deltas(updates) + det.finish() == expected == tok.decode(ids, skip_special_tokens=skip)
    # A skipped special token between the bytes of a character does not break it.
    det = IncrementalDetokenizer(tok)
    first, *rest = byte_ids(tok, "中")
    assert deltas(run(det, [[first], [specials["[EOS]"]], rest])) == "中"


def test_stop_inside_one_token(tok: Tokenizer) -> None:
    """A stop string inside a single token's text stops at that push and cuts right before the stop string."""
    text = "The quick brown fox"
    ids = tok.encode(text)
    k = next(k for k, i in enumerate(ids) if len(tok.decode([i])) >= 3 and k > 0)
    piece = tok.decode([ids[k]])
    stop = piece[1:-1]
    start = len(tok.decode(ids[:k])) + 1
    assert text.find(stop) == start
    det = IncrementalDetokenizer(tok, stop=[stop])
    updates = run(det, [[i] for i in ids])
    assert len(updates) == k + 1 and updates[-1].stop_string == stop and det.stopped
    assert det.text == deltas(updates) == text[:start]
    assert det.finish() == ""


def test_stop_spanning_tokens(tok: Tokenizer) -> None:
    """A stop string spread over several tokens is found when its last token arrives."""
    text = "The quick brown fox"
    ids = tok.encode(text)
    stop = "uick br"  # spans " qu" | "i" | "ck" | " b" | "ro"
    det = IncrementalDetokenizer(tok, stop=[stop])
    updates = run(det, [[i] for i in ids])
    assert updates[-1].stop_string == stop
    stop_end = text.index(stop) + len(stop)
    assert len(tok.decode(ids[: len(updates) - 1])) < stop_end <= len(tok.decode(ids[: len(updates)]))
    assert det.text == deltas(updates) == "The q"


def test_stop_at_very_start(tok: Tokenizer) -> None:
    """A stop string at the very start gives empty text and only empty deltas."""
    det = IncrementalDetokenizer(tok, stop=["Th"])
    updates = run(det, [[i] for i in tok.encode("The end")])
    assert updates[-1].stop_string == "Th" and det.text == "" and all(u.text_delta == "" for u in updates)


def test_earliest_of_several_stops_wins(tok: Tokenizer) -> None:
    """With several stop strings matching in one push, the one starting earliest ends the text."""
    det = IncrementalDetokenizer(tok, stop=["bar", "world", "lo w"])
    update = det.push(tok.encode("hello world, foo bar"))
    assert update == DetokenizerUpdate("hel", "lo w") and det.text == "hel"
    # A short stop that completes in an earlier push wins over a longer one that started earlier.
    det = IncrementalDetokenizer(tok, stop=["abcd", "c"])
    updates = run(det, char_ids(tok, "abcd"))
    assert updates[-1].stop_string == "c" and det.text == deltas(updates) == "ab"


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    """include_stop_str_in_output keeps the stop string and drops only what follows it."""
    for groups in ([tok.encode("hello world, foo")], [[i] for i in tok.encode("hello world, foo")]):
        det = IncrementalDetokenizer(tok, stop=["world", "foo"], include_stop_str_in_output=True)
        updates = run(det, groups)
        assert updates[-1].stop_string == "world"
        assert det.text == deltas(updates) == "hello world"


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    """Text that may start a stop string is held back, then released when the next text rules the stop out."""
    det = IncrementalDetokenizer(tok, stop=["abc"])
    assert [u.text_delta for u in run(det, char_ids(tok, "zabx"))] == ["z", "", "", "abx"]
    update = det.push(tok.encode("ab"))
    assert update.text_delta == "" and not det.stopped
    update = det.push(tok.encode("c!"))
    assert update == DetokenizerUpdate("", "abc") and det.text == "zabx"
    # Only the longest suffix that is a proper prefix is held: "aaa" with stop "aab" shows one "a".
    det = IncrementalDetokenizer(tok, stop=["aab"])
    assert [u.text_delta for u in run(det, char_ids(tok, "aaab"))] == ["", "", "a", ""]
    assert det.stopped and det.text == "a"
    # With include_stop_str_in_output nothing is ever held.
    det = IncrementalDetokenizer(tok, stop=["abc"], include_stop_str_in_output=True)
    assert [u.text_delta for u in run(det, char_ids(tok, "zabc"))] == ["z", "a", "b", "c"]


def test_min_tokens_delays_the_stop_check(tok: Tokenizer) -> None:
    """Stop strings are only matched in text of ids after the first min_tokens (vLLM); the look-back still works."""
    for min_tokens, stop, expected in ((0, "o", "f"), (3, "o", "foo b"), (3, "o ", "fo"), (7, "o", "foo boo")):
        for groups in (char_ids(tok, "foo boo"), [tok.encode("foo boo")]):
            det = IncrementalDetokenizer(tok, stop=[stop], min_tokens=min_tokens)
            updates = run(det, groups)
            if expected == "foo boo":
                assert not det.stopped and deltas(updates) + det.finish() == expected
            else:
                assert updates[-1].stop_string == stop and det.text == deltas(updates) == expected


def test_push_after_stop_or_finish_raises(tok: Tokenizer) -> None:
    """After a stop string (or finish()) further pushes raise RuntimeError."""
    det = IncrementalDetokenizer(tok, stop=["x"])
    assert det.push(tok.encode("axb")).stop_string == "x"
    with pytest.raises(RuntimeError):
        det.push(tok.encode("c"))
    det = IncrementalDetokenizer(tok)
    det.push(tok.encode("a"))
    assert det.finish() == ""
    with pytest.raises(RuntimeError):
        det.push(tok.encode("b"))


def test_finish_flushes_held_prefix_and_partial_char(tok: Tokenizer) -> None:
    """finish() returns held-back stop-prefix text and turns a dangling partial character into U+FFFD."""
    det = IncrementalDetokenizer(tok, stop=["abc"])
    assert det.push(tok.encode("xab")).text_delta == "x"
    assert det.finish() == "ab" and det.text == "xab" and not det.stopped
    ids = [*tok.encode("ok "), *byte_ids(tok, "中")[:2]]
    det = IncrementalDetokenizer(tok)
    assert det.push(ids).text_delta == "ok "
    assert det.finish() == "\ufffd" and det.text == tok.decode(ids) == "ok \ufffd"


def expected_stop(texts: list[str], stops: list[str], min_text_len: int, include: bool) -> tuple[int, str, str] | None:
    """Reference: (push index, stop string, final text) of the stop hit, from the text after each push.

    A match counts once its end lies past the first `min_text_len` chars; it is seen by the first push whose text
    reaches its end; among matches seen by the same push the earliest start wins, then the first stop string.
    """
    full = texts[-1] if texts else ""
    best = None
    for order, stop in enumerate(stops):
        start = full.find(stop)
        while start != -1:
            end = start + len(stop)
            if end > min_text_len:
                push = next(n for n, t in enumerate(texts) if len(t) >= end)
                key = (push, start, order)
                if best is None or key < best[0]:
                    best = (key, stop, full[: end if include else start])
            start = full.find(stop, start + 1)
    return None if best is None else (best[0][0], best[1], best[2])


def held_suffix(text: str, stops: list[str]) -> str:
    """Longest suffix of `text` that is a proper prefix of a stop string."""
    return max((text[-k:] for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), key=len, default="")


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_fuzz_against_reference(tok: Tokenizer, include: bool) -> None:
    """Fuzz: stop hits, final text and per-push deltas (hold-back) match a brute-force reference."""
    rng = random.Random(3)
    for _ in range(FUZZ_CASES):
        text = "".join(rng.choice("abc 中🙂") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc 中🙂") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        ids = tok.encode(text)
        min_tokens = rng.choice([0, 0, rng.randint(0, len(ids) + 1)])
        groups = random_groups(ids, rng)
        # Complete characters decoded after each push (a partial character's bytes are not text yet).
        cumulative = [sum(len(g) for g in groups[: n + 1]) for n in range(len(groups))]
        texts = [tok.decode_bytes(ids[:n]).decode(errors="ignore") for n in cumulative]
        min_text_len = len(tok.decode_bytes(ids[:min_tokens]).decode(errors="ignore"))
        expected = expected_stop(texts, stops, min_text_len, include)

        det = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
        shown = ""
        for n, group in enumerate(groups):
            update = det.push(group)
            shown += update.text_delta
            if det.stopped:
                break
            assert update.stop_string is None
            hold = "" if include else held_suffix(texts[n], stops)
            assert shown + hold == texts[n]
        if expected is None:
            assert not det.stopped and shown + det.finish() == text == det.text
        else:
            assert det.stopped and (n, update.stop_string, shown) == expected and det.text == shown


def test_push_decodes_only_new_ids(tok: Tokenizer) -> None:
    """Each push decodes only its own ids (O(new tokens)), never the whole output again."""
    seen: list[int] = []

    class CountingTokenizer:
        def decode_bytes(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> bytes:
            seen.extend(ids)
            return tok.decode_bytes(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXTS[2] * 4)
    det = IncrementalDetokenizer(CountingTokenizer(), stop=["never"], min_tokens=5)  # type: ignore[arg-type]
    assert deltas(run(det, [[i] for i in ids])) + det.finish() == TEXTS[2] * 4
    assert seen == ids


def test_rejects_bad_arguments_and_ids(tok: Tokenizer) -> None:
    """Empty stop strings and negative min_tokens are refused; an out-of-vocab id raises and leaves state intact."""
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop=["ok", ""])
    with pytest.raises(ValueError, match="min_tokens"):
        IncrementalDetokenizer(tok, min_tokens=-1)
    det = IncrementalDetokenizer(tok)
    first, *rest = byte_ids(tok, "中")
    det.push([first])
    with pytest.raises(ValueError):
        det.push([rest[0], VOCAB])
    assert det.push(rest).text_delta == "中"
