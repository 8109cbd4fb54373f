"""The embedded default model: a small Kimi Linear checkpoint with a small vision tower, trained offline
(`scripts/train_tiny.py`, then `scripts/train_vision.py`), package data.

`LLM()` and `deltaserve serve` without a model load it; its data, commands, seed and held-out results are in
`MODEL_CARD.md` beside this file.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "deltaserve-tiny-tools"
"""The name the server reports for the embedded model when no `--served-model-name` is given."""


DRAFT_PATH = Path(__file__).resolve().parent / "draft"
"""The embedded model's draft model (same tokenizer; `scripts/train_draft_model.sh`): the default checkpoint of
speculative decoding's `draft_model` method."""


DSPARK_PATH = Path(__file__).resolve().parent / "dspark"
"""The embedded model's block drafter (`scripts/train_dspark.py`): the default checkpoint of speculative decoding's
`dspark` method for the embedded model."""


def default_model_dir() -> Path:
    """Directory of the embedded checkpoint (config.json, model.safetensors, tokenizer files)."""
    return Path(__file__).resolve().parent
