"""Tests for deltaserve.text: the Tokenizer loader (tokenizers and Kimi tiktoken formats) and the tiny tokenizer."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import regex
import tiktoken

from deltaserve.text.tiny_tokenizer import (
    MIN_VOCAB_SIZE,
    TINY_K3_SPECIAL_TOKENS,
    TINY_SPECIAL_TOKENS,
    write_tiny_tokenizer,
)
from deltaserve.text.tokenizer import KIMI_PAT_STR, Tokenizer, TokenLimitExceeded, split_long_runs

VOCAB = 1024
FORMATS = ("tokenizers", "tiktoken")
TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 2024, we're here!",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\tprint({'k': [1, 2, 3]})\n",
    "Café naïve résumé é, 中文字符 and 日本語, emoji 😀🎉🚀 👩‍👩‍👧, ΑΒΓ αβγ.",
    "   leading and trailing whitespace \r\n\r\n  ",
    "",
)


@pytest.fixture(scope="module", params=FORMATS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, dict]:
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    ids = write_tiny_tokenizer(out, VOCAB, fmt=request.param)
    return Tokenizer.from_pretrained(out), ids


def test_tiny_tokenizer_round_trips(tiny: tuple[Tokenizer, dict]) -> None:
    """decode(encode(s)) == s for English, code, whitespace and non-ASCII text, in both formats."""
    tok, _ = tiny
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < VOCAB - len(TINY_SPECIAL_TOKENS) for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode()


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_tokenizer_is_deterministic(fmt: str, tmp_path: Path) -> None:
    """Two writes with the same arguments produce byte-identical files."""
    write_tiny_tokenizer(tmp_path / "a", 512, fmt=fmt)
    write_tiny_tokenizer(tmp_path / "b", 512, fmt=fmt)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir()) and len(names) == 2
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tiny_tokenizer_specials_sit_on_top(tiny: tuple[Tokenizer, dict]) -> None:
    """vocab_size is exact and the Kimi specials take the last ids in the documented order."""
    tok, ids = tiny
    first = VOCAB - len(TINY_SPECIAL_TOKENS)
    assert tok.vocab_size == VOCAB
    assert tok.special_tokens == {name: first + k for k, name in enumerate(TINY_SPECIAL_TOKENS)}
    assert tok.all_special_ids == frozenset(range(first, VOCAB))
    assert ids == {"bos_token_id": first, "eos_token_id": first + 2, "pad_token_id": VOCAB - 1}
    assert tok.bos_token_id == first and tok.pad_token_id == VOCAB - 1 and tok.unk_token_id == VOCAB - 2
    assert tok.eos_token_ids == (first + 1,)  # tokenizer_config's [EOS]; no generation_config written
    assert tok.id_to_token(first + 2) == "<|im_end|>" and tok.token_to_id("[PAD]") == VOCAB - 1
    assert tok.id_to_token(VOCAB) is None


def test_special_token_text_honours_allow_special(tiny: tuple[Tokenizer, dict]) -> None:
    """'<|im_end|>' is one special id when allowed and several ordinary ids when not."""
    tok, ids = tiny
    assert tok.encode("<|im_end|>") == [ids["eos_token_id"]]
    plain = tok.encode("<|im_end|>", allow_special=False)
    assert len(plain) > 1 and not set(plain) & tok.all_special_ids
    assert tok.decode(plain) == "<|im_end|>"


def test_decode_skips_special_tokens(tiny: tuple[Tokenizer, dict]) -> None:
    """decode(skip_special_tokens=True) drops special ids and keeps the text around them."""
    tok, _ = tiny
    ids = tok.encode("<|im_user|>user<|im_middle|>Hi 中文<|im_end|>")
    assert tok.decode(ids) == "<|im_user|>user<|im_middle|>Hi 中文<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "userHi 中文"


def test_decode_bytes_is_utf8_safe_per_token(tiny: tuple[Tokenizer, dict]) -> None:
    """Per-token decode_bytes concatenates to the exact UTF-8 even when tokens split a character."""
    tok, _ = tiny
    text = "🤖 ünïcödé 今天天气很好"
    ids = tok.encode(text)
    pieces = [tok.decode_bytes([i]) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(_is_partial_utf8(p) for p in pieces)  # the test really covers split characters


def test_decode_rejects_out_of_range_ids(tiny: tuple[Tokenizer, dict]) -> None:
    """An id outside [0, vocab_size) is a ValueError, not garbage or a crash."""
    tok, _ = tiny
    with pytest.raises(ValueError, match=str(VOCAB)):
        tok.decode([1, VOCAB])


def test_tiny_formats_give_the_same_ids(tmp_path: Path) -> None:
    """The tiktoken and tokenizers writes of one tiny tokenizer agree id for id and spelling for spelling."""
    write_tiny_tokenizer(tmp_path / "hf", VOCAB)
    write_tiny_tokenizer(tmp_path / "tt", VOCAB, fmt="tiktoken")
    hf, tt = Tokenizer.from_pretrained(tmp_path / "hf"), Tokenizer.from_pretrained(tmp_path / "tt")
    assert (hf.kind, tt.kind) == ("tokenizers", "tiktoken")
    for text in (*TEXTS, "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"):
        assert hf.encode(text) == tt.encode(text)
    assert [hf.id_to_token(i) for i in range(VOCAB)] == [tt.id_to_token(i) for i in range(VOCAB)]


def test_tiny_tokenizer_json_loads_in_transformers(tmp_path: Path) -> None:
    """PreTrainedTokenizerFast reads the tiny tokenizer.json and gives the same ids."""
    transformers = pytest.importorskip("transformers")
    write_tiny_tokenizer(tmp_path, VOCAB)
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "<|im_user|>user<|im_middle|>" + TEXTS[2] + "<|im_end|>"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert len(theirs) == VOCAB
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (
        ours.bos_token_id,
        ours.eos_token_ids[0],
        ours.pad_token_id,
    )


def test_tiny_tokenizer_rejects_small_vocab(tmp_path: Path) -> None:
    """A vocab_size below the minimum is a ValueError naming vocab_size."""
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_tokenizer(tmp_path, MIN_VOCAB_SIZE - 1)


def test_tiny_tokenizer_k3_flavour(tmp_path: Path) -> None:
    """flavor="k3" puts K3's specials on top (config eos <|end_of_msg|>); the default stays the K2 set."""
    ids = write_tiny_tokenizer(tmp_path, VOCAB, fmt="tiktoken", flavor="k3")
    tok = Tokenizer.from_pretrained(tmp_path)
    first = VOCAB - len(TINY_K3_SPECIAL_TOKENS)
    assert tok.special_tokens == {name: first + k for k, name in enumerate(TINY_K3_SPECIAL_TOKENS)}
    assert ids == {"bos_token_id": first, "eos_token_id": first + 2, "pad_token_id": VOCAB - 1}
    assert tok.id_to_token(first + 2) == "<|end_of_msg|>" and "<|im_end|>" not in tok.special_tokens
    assert tok.encode("<|open|>message<|sep|>") == [first + 3, *tok.encode("message"), first + 5]
    with pytest.raises(ValueError, match="flavor"):
        write_tiny_tokenizer(tmp_path, VOCAB, flavor="k4")


MERGES = (b"th", b"he", b"the", b" the", b"in", b"ing", b"  ", b"    ", b"12", b"123", b"\xe4\xb8")


def _write_hand_tiktoken(directory: Path) -> tuple[dict[bytes, int], dict[str, int]]:
    """256 single bytes + MERGES as `tiktoken.model`, and a config naming some of the 10 special ids."""
    ranks = {bytes([b]): b for b in range(256)} | {m: 256 + k for k, m in enumerate(MERGES)}
    lines = "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    (directory / "tiktoken.model").write_text(lines)
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 6: "<|im_middle|>", n + 9: "[PAD]"}
    decoder = {str(i): {"content": c, "special": True} for i, c in named.items()}
    config = {"added_tokens_decoder": decoder, "bos_token": {"content": "[BOS]"}, "eos_token": "[EOS]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 10)}
    return ranks, specials


def test_tiktoken_loader_matches_direct_encoding(tmp_path: Path) -> None:
    """Ids agree with a tiktoken.Encoding built by hand; unnamed ids are <|reserved_token_{i}|>."""
    ranks, specials = _write_hand_tiktoken(tmp_path)
    direct = tiktoken.Encoding("direct", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    tok = Tokenizer.from_pretrained(tmp_path)
    n = len(ranks)
    assert tok.kind == "tiktoken" and tok.vocab_size == n + 10
    assert tok.special_tokens == specials
    assert tok.id_to_token(n + 3) == f"<|reserved_token_{n + 3}|>"
    assert tok.bos_token_id == n and tok.eos_token_ids == (n + 1,) and tok.pad_token_id is None
    for text in (*TEXTS, f"the thing 12345 <|im_end|> 中文 <|reserved_token_{n + 4}|>"):
        assert tok.encode(text) == direct.encode(text, allowed_special="all")
        assert tok.encode(text, allow_special=False) == direct.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    lone = "a lone \ud800 surrogate"  # replaced by U+FFFD, as tiktoken's own encodes do
    assert tok.encode(lone) == direct.encode(lone, allowed_special="all")
    assert tok.encode(lone, allow_special=False) == direct.encode_ordinary(lone)
    assert tok.encode(lone) == tok.encode("a lone \ufffd surrogate")
    assert tok.token_to_id("Ġthe") == 259 and tok.id_to_token(32) == "Ġ"  # byte-level spelling of b" "


def test_tiktoken_long_runs_encode_and_round_trip(tmp_path: Path) -> None:
    """100k spaces and other long runs round-trip, sliced exactly as Kimi does (400k chars, 25k-char runs)."""
    ranks, specials = _write_hand_tiktoken(tmp_path)
    direct = tiktoken.Encoding("direct", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    tok = Tokenizer.from_pretrained(tmp_path)
    texts = (" " * 100_000, "x" + " " * 100_000 + "y", "the" * 40_000 + "\n" * 30_000, "thing " * 70_000)
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        slices = (text[i : i + 400_000] for i in range(0, len(text), 400_000))
        assert ids == [t for s in slices for piece in _kimi_split(s, 25_000) for t in direct.encode_ordinary(piece)]
    assert tok.encode("the" * 40_000) != direct.encode("the" * 40_000)  # the 25k cut is observable
    assert tok.encode("thing " * 70_000) != direct.encode("thing " * 70_000)  # so is the 400k cut
    assert len(tok.encode(" " * 100_000)) <= 100_000 // 4 + 4  # merged in 4-space tokens, cut at 25k runs


def _kimi_split(s: str, max_run: int) -> Iterator[str]:
    """Kimi's `_split_whitespaces_or_nonwhitespaces`, re-stated as the oracle for split_long_runs."""
    run_len, run_is_space, start = 0, s[0].isspace() if s else False, 0
    for i, ch in enumerate(s):
        if run_is_space != ch.isspace():
            run_len, run_is_space = 1, ch.isspace()
        else:
            run_len += 1
            if run_len > max_run:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


def test_split_long_runs_matches_kimi_splitter() -> None:
    """split_long_runs cuts at exactly the same places as Kimi's per-character splitter."""
    rng = random.Random(0)
    for _ in range(300):
        s = "".join(rng.choice("ab \n\u3000é") * rng.randint(1, 9) for _ in range(rng.randint(0, 12)))
        max_run = rng.randint(1, 6)
        assert list(split_long_runs(s, max_run)) == list(_kimi_split(s, max_run))


def test_split_long_runs_at_kimi_size_matches_kimi_splitter() -> None:
    """At the real 25k limit, runs just under, at and past one and two limits, anywhere in ordinary text, whitespace
    or not, are cut where Kimi's splitter cuts (the fast path samples every 12,500th character)."""
    rng = random.Random(1)
    for length in (12_500, 12_501, 25_000, 25_001, 37_502, 50_001):
        for fill in ("x", " ", "\n"):
            for _ in range(3):
                before = "".join(rng.choice(["the ", "a\n", "xy"]) for _ in range(rng.randint(0, 9000)))
                text = before + fill * length + "b c" * rng.randint(0, 3)
                assert list(split_long_runs(text)) == list(_kimi_split(text, 25_000))


@pytest.mark.parametrize("allow_special", [True, False])
def test_encode_with_max_tokens_is_exact_or_refused(tiny: tuple[Tokenizer, dict], allow_special: bool) -> None:
    """With max_tokens, a text of at most that many tokens gets exactly its ids; one token fewer is refused with
    TokenLimitExceeded naming the limit (texts of several 400k-character chunks included)."""
    tok, _ = tiny
    for text in (*TEXTS, "<|im_end|> then text", "thing the 123 " * 60_000):
        full = tok.encode(text, allow_special=allow_special)
        assert tok.encode(text, allow_special=allow_special, max_tokens=len(full)) == full
        assert tok.encode(text, allow_special=allow_special, max_tokens=len(full) + 5) == full
        if full:
            with pytest.raises(TokenLimitExceeded) as info:
                tok.encode(text, allow_special=allow_special, max_tokens=len(full) - 1)
            assert info.value.limit == len(full) - 1 and str(len(full) - 1) in str(info.value)


def test_tiktoken_encode_past_max_tokens_stops_at_the_first_piece(tmp_path: Path, monkeypatch) -> None:
    """A text of megabytes past max_tokens is refused after its first 400k-character piece: the rest is never
    encoded (what keeps a prompt far past a server's context cheap to refuse)."""
    write_tiny_tokenizer(tmp_path, VOCAB, fmt="tiktoken")
    tok = Tokenizer.from_pretrained(tmp_path)
    backend = tok._backend
    produced: list[int] = []
    encode_piece = backend._encode_piece

    def counting(piece, allowed):
        array = encode_piece(piece, allowed)
        produced.append(len(array))
        return array

    monkeypatch.setattr(backend, "_encode_piece", counting)
    text = "the scheduler gives each request tokens under a budget; " * 40_000  # 2.2M characters
    total = len(tok.encode(text, allow_special=False))
    assert len(produced) == 6 and sum(produced) == total  # six pieces when encoded whole
    produced.clear()
    with pytest.raises(TokenLimitExceeded):
        tok.encode(text, allow_special=False, max_tokens=1000)
    assert len(produced) == 1 and sum(produced) < total / 5


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("中文abc日本語", ["中文", "abc", "日本語"]),
        ("I'm they'RE we'll", ["I'm", " they'RE", " we'll"]),
        ("1234567", ["123", "456", "7"]),
        ("x = f(y)\n\n  z", ["x", " =", " f", "(y", ")\n\n", " ", " z"]),
        ("a  \n b   ", ["a", "  \n", " b", "   "]),
    ],
    ids=["han", "contractions", "digits", "punct", "whitespace"],
)
def test_kimi_pat_str_splits_as_specified(text: str, pieces: list[str]) -> None:
    """KIMI_PAT_STR: Han runs apart, English contractions kept, digits in groups of at most 3 (spec §11)."""
    assert regex.findall(KIMI_PAT_STR, text, flags=regex.V1) == pieces


def test_missing_files_raise_file_not_found(tmp_path: Path) -> None:
    """A directory without tokenizer files gives a FileNotFoundError naming both files and the directory."""
    for directory in (tmp_path, tmp_path / "absent"):
        with pytest.raises(FileNotFoundError) as info:
            Tokenizer.from_pretrained(directory)
        assert "tokenizer.json" in str(info.value) and "tiktoken.model" in str(info.value)
        assert str(directory) in str(info.value)


def test_eos_token_ids_merge_configs(tmp_path: Path) -> None:
    """eos_token_ids is tokenizer_config's eos, then generation_config's and config.json's ids, de-duplicated."""
    ids = write_tiny_tokenizer(tmp_path, 512)
    eot = Tokenizer.from_pretrained(tmp_path).token_to_id("[EOT]")
    eos = Tokenizer.from_pretrained(tmp_path).eos_token_ids[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["eos_token_id"], eos]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (eos, ids["eos_token_id"], eot)


def test_bad_configs_name_file_and_field(tmp_path: Path) -> None:
    """Broken tokenizer_config / generation_config values raise ValueErrors naming the file and field."""
    ranks, _ = _write_hand_tiktoken(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    good = json.loads(config_path.read_text())
    cases = [
        ({**good, "pad_token": "[NOPE]"}, "pad_token"),
        ({**good, "added_tokens_decoder": {"3": {"content": "[X]"}}}, "added_tokens_decoder"),
        ({**good, "added_tokens_decoder": {"x": {"content": "[X]"}}}, "added_tokens_decoder"),
        ({**good, "eos_token": 7}, "eos_token"),
    ]
    for config, field in cases:
        config_path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=rf"tokenizer_config\.json.*{field}"):
            Tokenizer.from_pretrained(tmp_path)
    config_path.write_text(json.dumps(good))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": len(ranks) + 99}))
    with pytest.raises(ValueError, match=r"generation_config\.json.*eos_token_id"):
        Tokenizer.from_pretrained(tmp_path)


def _is_partial_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
