"""Text side of the engine: tokenizer loading (no remote code) and a tiny offline tokenizer for tests."""

from __future__ import annotations

from deltaserve.text.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
