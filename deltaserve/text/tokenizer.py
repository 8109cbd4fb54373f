"""Text tokenizer: loads a `tokenizer.json` (HF `tokenizers`) or a Kimi `tiktoken.model` without remote code.

Owns encode/decode, the special-token tables and the bos/eos/pad ids read from the checkpoint's JSON files.

Encoding runs in a server's worker threads beside its event loop, so every step that holds the GIL is kept short:
the libraries' encodes release it, and the ids become Python ints (which needs the GIL) only in pieces, and only
once the text is known to fit `max_tokens` when a caller gives one (a prompt of megabytes past the context is
refused without building its id list).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tiktoken
import tokenizers
from tiktoken.load import load_tiktoken_bpe

# `TikTokenTokenizer.pat_str` of Moonshot's `tokenization_kimi.py` (identical in K2, Kimi Linear and K3); model-spec
# §11. The `&&` class intersections need tiktoken's (or Oniguruma's, or `regex` V1's) engine, not Python's `re`.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tiktoken panics above this (Kimi's limit)
MAX_CONSECUTIVE_RUN_CHARS = 25_000  # longest whitespace / non-whitespace run handed to tiktoken at once
NUM_RESERVED_SPECIAL_TOKENS = 256  # Kimi's special block size, used when tokenizer_config names no tokens
TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"


class TokenLimitExceeded(ValueError):
    """The text (or the prompt being rendered from it) has more than `limit` tokens; raised by an encode or a chat
    render given `max_tokens=limit` as soon as that is known, before the encoding is finished."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the text has more than {limit} tokens")
        self.limit = limit


@functools.lru_cache(maxsize=8)
def _run_patterns(max_run: int) -> tuple[int, re.Pattern[str], re.Pattern[str]]:
    """(step, a run of more than `step` characters at a position, a whole run longer than `max_run`), with step =
    max_run // 2. `re`'s \\s is exactly str.isspace(), as Kimi's splitter uses. The lookbehinds let a whole-run
    match start only where a run starts, so its scan is linear."""
    step = max(max_run // 2, 1)
    return (step, re.compile(rf"\s{{{step + 1}}}|\S{{{step + 1}}}"),
            re.compile(rf"(?<!\s)\s{{{max_run + 1},}}|(?<!\S)\S{{{max_run + 1},}}"))


def split_long_runs(text: str, max_run: int = MAX_CONSECUTIVE_RUN_CHARS) -> Iterator[str]:
    """Cut `text` inside every whitespace / non-whitespace run longer than `max_run`, every `max_run` chars.

    Yields the same pieces as `_split_whitespaces_or_nonwhitespaces` of `tokenization_kimi.py` (at least one piece,
    possibly empty); their concatenation is `text`. Only the long runs are visited, not every run (a Python loop
    over all of them took 0.7 s for 8 MB of text).
    """
    step, sample, long_run = _run_patterns(max_run)
    start = 0
    # A run longer than max_run holds a multiple of step with more than step characters of the run after it: for
    # ordinary text a few short matches rule every long run out, where the whole-run scan holds the GIL for 16 ms
    # per 400,000 characters.
    if any(sample.match(text, p) for p in range(0, len(text), step)):
        for run in long_run.finditer(text):
            for cut in range(run.start() + max_run, run.end(), max_run):
                yield text[start:cut]
                start = cut
    yield text[start:]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the token spelling used by byte-level BPE files)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class _Backend(Protocol):
    vocab_size: int
    special_tokens: dict[str, int]  # every token matched as a whole by encode(allow_special=True)
    skippable_ids: frozenset[int]  # ids dropped by decode(skip_special_tokens=True)

    def encode(self, text: str, allow_special: bool, max_tokens: int | None) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def decode_bytes(self, ids: list[int]) -> bytes: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...


class _TokenizersBackend:
    """`tokenizer.json` through the HF `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        # The batch encodes release the GIL (`encode` holds it); the fast one, where the installed tokenizers has
        # it, computes no offsets, which makes it twice as fast and its Encoding (whose freeing holds the GIL: 270 ms
        # for 2.7M tokens with offsets) cheap to drop. Same ids.
        self._fast = hasattr(self._tok, "encode_batch_fast")
        # A second instance with `encode_special_tokens` set spells special tokens as plain text; a copy rather
        # than toggling the flag keeps encode free of shared mutable state.
        self._plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in sorted(added.items())}
        self.skippable_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._added = {i: t.content.encode() for i, t in added.items()}
        self._byte_level = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        self._unbyte = {c: b for b, c in bytes_to_unicode().items()}

    def encode(self, text: str, allow_special: bool, max_tokens: int | None) -> list[int]:
        tok = self._tok if allow_special else self._plain
        batch = tok.encode_batch_fast if self._fast else tok.encode_batch
        encoding = batch([text], add_special_tokens=False)[0]
        if max_tokens is not None and len(encoding) > max_tokens:  # counted without building the id list
            raise TokenLimitExceeded(max_tokens)
        return encoding.ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        if not self._byte_level:  # no byte spelling to invert: fall back to the (replacement-char) text decode
            return self.decode(ids).encode()
        out = bytearray()
        for i in ids:
            added = self._added.get(i)
            if added is not None:
                out += added
            elif (token := self._tok.id_to_token(i)) is not None:  # an id missing from the vocab: nothing, as decode
                out += bytes(self._unbyte[c] for c in token)
        return bytes(out)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class _TiktokenBackend:
    """Kimi's `tiktoken.model` + `pat_str` + the special block named by `added_tokens_decoder` (model-spec §11)."""

    def __init__(self, path: Path, added_tokens_decoder: Any, config_path: Path) -> None:
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # malformed line: tiktoken raises ValueError / binascii.Error
            raise ValueError(f"{path}: not a tiktoken BPE file ('base64(token) rank' per line): {e}") from e
        n_base = len(ranks)
        if sorted(ranks.values()) != list(range(n_base)):
            raise ValueError(f"{path}: ranks must be exactly 0..{n_base - 1} with no gaps or repeats")
        named, skippable = _parse_added_tokens(added_tokens_decoder, n_base, config_path)
        end = max(named) + 1 if named else n_base + NUM_RESERVED_SPECIAL_TOKENS
        names = {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, end)}
        self.special_tokens = {name: i for i, name in names.items()}
        if len(self.special_tokens) != len(names):
            raise ValueError(f"{config_path}: field 'added_tokens_decoder' repeats a token name")
        self.skippable_ids = frozenset(skippable | (names.keys() - named.keys()))
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "kimi",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = end
        self._n_base = n_base
        self._spellings: list[str] | None = None
        self._ids: dict[str, int] | None = None

    def encode(self, text: str, allow_special: bool, max_tokens: int | None) -> list[int]:
        # Each piece is encoded to a uint32 array with the GIL released, counted, and turned into Python ints only
        # once the whole text is known to fit: ids identical to `encode` / `encode_ordinary` of each piece.
        allowed: AbstractSet[str] = self._enc.special_tokens_set if allow_special else frozenset()
        arrays = []
        count = 0
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS]):
                array = self._encode_piece(piece, allowed)
                count += len(array)
                if max_tokens is not None and count > max_tokens:
                    raise TokenLimitExceeded(max_tokens)
                arrays.append(array)
        if len(arrays) == 1:  # most texts: their ids without a copy
            return arrays[0].tolist()
        ids: list[int] = []
        for array in arrays:  # a conversion per piece: the GIL is held for one piece's ids at a time
            ids += array.tolist()
        return ids

    def _encode_piece(self, piece: str, allowed: AbstractSet[str]) -> np.ndarray:
        try:
            return self._enc.encode_to_numpy(piece, allowed_special=allowed, disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate: replaced, as tiktoken's own `encode` does
            piece = piece.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self._enc.encode_to_numpy(piece, allowed_special=allowed, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._enc.decode_bytes(ids)

    def _tables(self) -> tuple[list[str], dict[str, int]]:
        if self._spellings is None or self._ids is None:  # built on first use: 160k entries for real Kimi
            b2u = bytes_to_unicode()
            single = self._enc.decode_single_token_bytes
            spellings = ["".join(b2u[b] for b in single(i)) for i in range(self._n_base)]
            spellings += list(self.special_tokens)
            self._spellings, self._ids = spellings, {s: i for i, s in enumerate(spellings)}
        return self._spellings, self._ids

    def token_to_id(self, token: str) -> int | None:
        return self._tables()[1].get(token)

    def id_to_token(self, token_id: int) -> str | None:
        spellings = self._tables()[0]
        return spellings[token_id] if 0 <= token_id < len(spellings) else None


def _parse_added_tokens(decoder: Any, n_base: int, path: Path) -> tuple[dict[int, str], set[int]]:
    """`added_tokens_decoder` ({"163584": {"content": "[BOS]", "special": true}, ...}) -> names by id, special ids."""
    if decoder is None:
        return {}, set()
    field = "added_tokens_decoder"
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: field {field!r} must be an object mapping ids to tokens")
    named: dict[int, str] = {}
    special: set[int] = set()
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{path}: field {field!r} has a non-integer id {key!r}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{path}: field {field}[{key!r}] needs a string 'content'")
        if token_id < n_base:
            raise ValueError(f"{path}: field {field}[{key!r}] collides with the {n_base} base ranks")
        named[token_id] = entry["content"]
        if entry.get("special", True):
            special.add(token_id)
    return named, special


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def _token_content(config: dict[str, Any], field: str, path: Path) -> str | None:
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: field {field!r} must be a string or an object with a string 'content'")
    return value


class Tokenizer:
    """Encode/decode plus special-token ids for one checkpoint directory; build with `from_pretrained`.

    `special_tokens` holds every token that `encode(allow_special=True)` matches as a whole (added tokens, or the
    whole Kimi special block including `<|reserved_token_{i}|>`); `all_special_ids` is the subset flagged special
    (plus the unnamed reserved ids), which `decode(skip_special_tokens=True)` drops. Thread-safe for encode/decode.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        kind: str,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int | None,
        unk_token_id: int | None,
    ) -> None:
        self._backend = backend
        self.kind = kind  # "tokenizers" or "tiktoken"
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids  # stop tokens: tokenizer_config, then generation_config, then config
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a directory holding `tokenizer.json` or `tiktoken.model` (+ optional JSON configs)."""
        directory = Path(path)
        tok_config_path = directory / TOKENIZER_CONFIG
        tok_config = _read_json(tok_config_path)
        if (directory / TOKENIZER_JSON).is_file():
            backend: _Backend = _TokenizersBackend(directory / TOKENIZER_JSON)
            kind, defaults = "tokenizers", {}
        elif (directory / TIKTOKEN_MODEL).is_file():
            added = tok_config.get("added_tokens_decoder")
            backend = _TiktokenBackend(directory / TIKTOKEN_MODEL, added, tok_config_path)
            kind, defaults = "tiktoken", {"bos_token": "[BOS]", "eos_token": "[EOS]"}  # tokenization_kimi's
        else:
            raise FileNotFoundError(
                f"no tokenizer found in {directory}: expected {TOKENIZER_JSON} or {TIKTOKEN_MODEL}"
                + ("" if directory.is_dir() else " (the directory does not exist)")
            )

        def lookup(field: str) -> int | None:
            content = _token_content(tok_config, field, tok_config_path)
            if content is None:  # absent: tiktoken falls back to Kimi's defaults when they exist
                default = defaults.get(field) if field not in tok_config else None
                return backend.special_tokens.get(default) if default is not None else None
            token_id = backend.special_tokens.get(content)
            if token_id is None:
                token_id = backend.token_to_id(content)
            if token_id is None:
                raise ValueError(f"{tok_config_path}: field {field!r} names {content!r}, not in the vocabulary")
            return token_id

        eos: list[int] = []
        if (eos_id := lookup("eos_token")) is not None:
            eos.append(eos_id)
        for name in ("generation_config.json", "config.json"):
            eos += _eos_ids(directory / name, backend.vocab_size)
        return cls(
            backend,
            kind=kind,
            bos_token_id=lookup("bos_token"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            pad_token_id=lookup("pad_token"),
            unk_token_id=lookup("unk_token"),
        )

    def encode(self, text: str, *, allow_special: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; no BOS is added. With `allow_special=False` special-token text is plain text.

        With `max_tokens`, a text of more tokens raises `TokenLimitExceeded` instead, as soon as that is known: the
        Kimi format stops at the first 400,000-character chunk that passes it, and neither format builds the id
        list (what a server wants for a prompt past its context). Ids of a text that fits are the same.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, allow_special, max_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a partial character) decodes to U+FFFD."""
        return self._backend.decode(self._checked(ids, skip_special_tokens))

    def decode_bytes(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> bytes:
        """Raw UTF-8 bytes of `ids` (may end mid-character), for incremental detokenisation."""
        return self._backend.decode_bytes(self._checked(ids, skip_special_tokens))

    def _checked(self, ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
        vocab = self._backend.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if skip_special_tokens:
            skip = self._backend.skippable_ids
            return [i for i in ids if i not in skip]
        return list(ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._backend.vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every whole-match token by name (a copy)."""
        return dict(self._backend.special_tokens)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids dropped by `decode(skip_special_tokens=True)`."""
        return self._backend.skippable_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary (byte-level spelling for BPE tokens, or a special name)."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of `token_id`, or None when out of range."""
        return self._backend.id_to_token(token_id)


def _eos_ids(path: Path, vocab_size: int) -> list[int]:
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{path}: field 'eos_token_id' must be an id or a list of ids below {vocab_size}")
    return values
