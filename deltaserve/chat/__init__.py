"""Chat formats: prompt rendering (Python render programs, not Jinja) and tool-call / answer grammars per family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaserve.chat.format import ChatFormat
from deltaserve.chat.kimi_k2 import KimiK2Format
from deltaserve.chat.kimi_k3 import KimiK3Format
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.text.tokenizer import Tokenizer

FORMATS: dict[str, type[ChatFormat]] = {KimiK2Format.name: KimiK2Format, KimiK3Format.name: KimiK3Format}
_K2_MODEL_TYPES = ("kimi_linear", "kimi_k2", "kimi_k25", "deepseek_v3")
_K2_ARCHITECTURES = ("KimiLinearForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")

__all__ = ["FORMATS", "ChatFormat", "ChatMessage", "KimiK2Format", "KimiK3Format", "ToolSpec", "get_chat_format"]


def get_chat_format(model_dir: str | Path, tokenizer: Tokenizer, name: str | None = None) -> ChatFormat:
    """The chat format of the checkpoint in `model_dir`, built on its `tokenizer`.

    Args:
        name: "kimi_k2" or "kimi_k3" overrides the choice; otherwise `config.json` decides: a Kimi K3 config
            (top-level `model_type` containing "k3", or an architecture naming K3) gives kimi_k3, Kimi Linear / K2
            gives kimi_k2.

    Raises:
        ValueError: an unknown `name`, a config naming neither family, or a tokenizer that lacks a special token
            the format needs (the message names the token).
    """
    if name is None:
        name = _format_name(_read_config(Path(model_dir)), Path(model_dir))
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}; accepted names: {', '.join(FORMATS)}")
    return FORMATS[name](tokenizer)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} not found: cannot choose a chat format; pass one of {', '.join(FORMATS)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return config


def _format_name(config: dict[str, Any], model_dir: Path) -> str:
    model_type = config.get("model_type")
    model_type = model_type.lower() if isinstance(model_type, str) else ""
    architectures = config.get("architectures")
    architectures = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    # Dispatch on the top level: K3's inner text_config says model_type "kimi_linear" (model-spec §14).
    if "k3" in model_type or any("k3" in a.lower() for a in architectures):
        return KimiK3Format.name
    if model_type in _K2_MODEL_TYPES or any(a in _K2_ARCHITECTURES for a in architectures):
        return KimiK2Format.name
    raise ValueError(
        f"{model_dir / 'config.json'}: model_type {config.get('model_type')!r} / architectures {architectures} "
        f"name no known chat format; pass one of {', '.join(FORMATS)}"
    )
