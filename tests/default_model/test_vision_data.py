"""The synthetic image data of the default model's vision training (`scripts/make_vision_data.py`): deterministic
per split and seed, the held-out split's pictures not the training's, every answer stating its label, and the
held-out phrasings absent from training."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_vision_data as mvd  # noqa: E402
from eval_vision import states_label  # noqa: E402


def _pixels(split: str, seed: int, n: int = 12) -> list[bytes]:
    rng = mvd.split_rng(split, seed)
    return [np.asarray(mvd.make_example(rng).image).tobytes() for _ in range(n)]


def test_deterministic_and_splits_disjoint():
    assert _pixels("train", 0) == _pixels("train", 0)
    assert not set(_pixels("train", 0)) & set(_pixels("heldout", 0))


def test_answers_state_their_labels_and_sizes_are_in_range():
    rng = mvd.split_rng("train", 3)
    kinds = set()
    for _ in range(200):
        ex = mvd.make_example(rng)
        kinds.add(ex.kind)
        assert states_label(ex, ex.answer), ex
        assert not states_label(ex, "I do not know."), ex
        w, h = ex.image.size
        assert 84 <= min(w, h) and max(w, h) <= 512 and ex.caption
    assert kinds == set(mvd.QUESTIONS)


def test_heldout_phrasings_are_not_training_phrasings():
    for kind, phrasings in mvd.HELDOUT_QUESTIONS.items():
        assert not set(phrasings) & set(mvd.QUESTIONS[kind])
