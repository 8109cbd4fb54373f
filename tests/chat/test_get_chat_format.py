"""`get_chat_format`: selection from the checkpoint config, the name override, and the special-token check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.chat import FORMATS, KimiK2Format, KimiK3Format, get_chat_format
from deltaserve.text.tokenizer import Tokenizer

KIMI_LINEAR = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
KIMI_K3 = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {"model_type": "kimi_linear"},
}


def checkpoint(root: Path, name: str, config: dict) -> Path:
    out = root / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def toks(k2_dir: Path, k3_dir: Path) -> tuple[Tokenizer, Tokenizer]:
    return Tokenizer.from_pretrained(k2_dir), Tokenizer.from_pretrained(k3_dir)


def test_selects_from_the_config(tmp_path: Path, toks) -> None:
    """Kimi Linear -> kimi_k2; a K3 config (top-level model_type / architectures) -> kimi_k3; a name overrides."""
    k2_tok, k3_tok = toks
    assert isinstance(get_chat_format(checkpoint(tmp_path, "linear", KIMI_LINEAR), k2_tok), KimiK2Format)
    k3_dir = checkpoint(tmp_path, "k3", KIMI_K3)
    assert isinstance(get_chat_format(k3_dir, k3_tok), KimiK3Format)
    arch_only = checkpoint(tmp_path, "arch", {"architectures": ["KimiK3ForCausalLM"]})
    assert get_chat_format(arch_only, k3_tok).name == "kimi_k3"
    assert get_chat_format(tmp_path / "missing", k3_tok, name="kimi_k3").name == "kimi_k3"
    assert get_chat_format(k3_dir, k2_tok, name="kimi_k2").name == "kimi_k2"
    assert set(FORMATS) == {"kimi_k2", "kimi_k3"}


def test_errors_name_what_is_wrong(tmp_path: Path, toks) -> None:
    """Unknown names list the accepted ones; a missing special token is named; unknown configs are refused."""
    k2_tok, k3_tok = toks
    with pytest.raises(ValueError, match="kimi_k2, kimi_k3"):
        get_chat_format(tmp_path, k2_tok, name="chatml")
    with pytest.raises(ValueError, match=r"<\|open\|>"):
        get_chat_format(checkpoint(tmp_path, "k3", KIMI_K3), k2_tok)
    with pytest.raises(ValueError, match=r"<\|im_end\|>"):
        get_chat_format(tmp_path, k3_tok, name="kimi_k2")
    with pytest.raises(ValueError, match="llama"):
        get_chat_format(checkpoint(tmp_path, "llama", {"model_type": "llama", "architectures": ["Llama"]}), k2_tok)
    with pytest.raises(ValueError, match="config.json not found"):
        get_chat_format(tmp_path / "missing", k2_tok)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="invalid JSON"):
        get_chat_format(tmp_path, k2_tok)


def test_make_parser_returns_the_family_parser(k2: KimiK2Format, k3: KimiK3Format) -> None:
    """make_parser builds the format's streaming parser (skipped until the parsers exist)."""
    for fmt, module, cls in ((k2, "deltaserve.parsers.kimi_k2", "KimiK2Parser"),
                             (k3, "deltaserve.parsers.kimi_k3", "KimiK3Parser")):  # fmt: skip
        mod = pytest.importorskip(module)
        parser = fmt.make_parser(fmt.tokenizer, thinking=True, tools=True)
        assert isinstance(parser, getattr(mod, cls))
