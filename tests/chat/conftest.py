"""Fixtures for the chat-format tests: tiny K2 and K3 tokenizers (written once per session), formats, llguidance."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast

from deltaserve.chat import KimiK2Format, KimiK3Format
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer
from deltaserve.text.tokenizer import TOKENIZER_JSON, Tokenizer

VOCAB = 1024


@pytest.fixture(scope="session")
def k2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat_k2_tok")
    write_tiny_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat_k3_tok")
    write_tiny_tokenizer(out, VOCAB, flavor="k3")
    return out


@pytest.fixture(scope="session")
def k2(k2_dir: Path) -> KimiK2Format:
    return KimiK2Format(Tokenizer.from_pretrained(k2_dir))


@pytest.fixture(scope="session")
def k3(k3_dir: Path) -> KimiK3Format:
    return KimiK3Format(Tokenizer.from_pretrained(k3_dir))


def _ll(tok_dir: Path, stop_ids: frozenset[int]) -> llguidance.LLTokenizer:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / TOKENIZER_JSON))
    return llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB, eos_token=sorted(stop_ids))


@pytest.fixture(scope="session")
def k2_ll(k2_dir: Path, k2: KimiK2Format) -> llguidance.LLTokenizer:
    return _ll(k2_dir, k2.stop_token_ids)


@pytest.fixture(scope="session")
def k3_ll(k3_dir: Path, k3: KimiK3Format) -> llguidance.LLTokenizer:
    return _ll(k3_dir, k3.stop_token_ids)
