"""Tokenizer fixtures for the parser tests: the tiny K2 tokenizer, and a small K3 one built here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import KIMI_PAT_STR, TOKENIZER_CONFIG, TOKENIZER_JSON, Tokenizer

K2_VOCAB = 1024
# Kimi K3's named specials in ascending id order (model-spec §11.2), [UNK] and [PAD] last.
K3_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[start_header_id]", "[end_header_id]",
    "[EOT]", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]",
)  # fmt: skip
_K3_CORPUS = """\
think response tools call tool argument key type string number boolean null object array json message role
The user asks for the weather in Paris. Let me look it up with the get_weather tool, then answer briefly.
{"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "verbose": true, "limit": null}
def main():\n    print("hello, world")\n    return 0\n
Café, naïve, Straße, 天地玄黄，宇宙洪荒。 日本語 emoji 😀🎉 and tabs\tand newlines.
"""


def write_k3_tokenizer(out_dir: Path, vocab_size: int = 600) -> None:
    """A byte-level BPE with Kimi's split regex and K3's special tokens, as `tokenizer.json` + config."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_K3_CORPUS.splitlines(keepends=True) * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in K3_SPECIAL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / TOKENIZER_JSON))
    decoder = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in K3_SPECIAL_TOKENS}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"}
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="session")
def k2_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("k2_tok")
    write_tiny_tokenizer(out, K2_VOCAB)
    return Tokenizer.from_pretrained(out)


@pytest.fixture(scope="session")
def k2_tiktoken_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("k2_tiktoken_tok")
    write_tiny_tokenizer(out, K2_VOCAB, fmt="tiktoken")
    return Tokenizer.from_pretrained(out)


@pytest.fixture(scope="session")
def k3_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("k3_tok")
    write_k3_tokenizer(out)
    return Tokenizer.from_pretrained(out)
