"""The default model's training data (`scripts/make_tool_data.py`): deterministic, the held-out split disjoint from
training, every final answer carrying what the evaluation looks for, and the opt-in mixes (list copies, neutral
phrasings) leaving the data of the stages that predate them unchanged, so the shipped chain stays reproducible."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_tool_data as mtd  # noqa: E402


def _digest(convs: list[mtd.Conversation]) -> str:
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.user, c.tool, c.arguments, c.result, c.answer, c.thinking, c.offer_tools],
                            sort_keys=True).encode())
    return h.hexdigest()[:16]


def test_data_of_earlier_stages_is_unchanged():
    """Digests taken with the generator as it was before `--list-share` / `--neutral-share` existed: new options at
    their default of 0 must not draw from the random stream."""
    assert _digest(mtd.make_conversations("train", 300, 0)) == "4c85e11b5c5cdec9"
    stage4 = mtd.make_conversations("train", 300, 3, synthetic=0.9, plain_share=0.8, short_copy=True)
    assert _digest(stage4) == "abdd69202c09872d"
    assert _digest(mtd.make_conversations("heldout", 300, 1, plain_share=0.0)) == "b1019958358acf7b"


def test_deterministic_for_a_seed():
    kw = {"synthetic": 0.9, "plain_share": 0.6, "short_copy": True, "list_share": 0.5, "neutral_share": 0.3}
    assert _digest(mtd.make_conversations("train", 200, 5, **kw)) == _digest(mtd.make_conversations("train", 200, 5,
                                                                                                     **kw))
    assert _digest(mtd.make_conversations("train", 200, 5, **kw)) != _digest(mtd.make_conversations("train", 200, 6,
                                                                                                    **kw))


def test_heldout_phrasings_and_values_are_disjoint_from_training():
    for kind, (train, held) in mtd.PHRASES.items():
        assert not set(train) & set(held), kind
        assert not set(mtd.NEUTRAL_PHRASES) & set(held), kind
    assert not set(mtd.CITIES) & set(mtd.HELDOUT_CITIES)
    assert not set(mtd.TIMEZONES) & set(mtd.HELDOUT_TIMEZONES)
    assert not set(mtd.PATTERNS) & set(mtd.HELDOUT_PATTERNS)
    assert not set(mtd.DIRECTORIES) & set(mtd.HELDOUT_DIRECTORIES)
    assert not set(mtd.TRAIN_UNIT_PAIRS) & set(mtd.HELDOUT_UNIT_PAIRS)
    train_users = {c.user for c in mtd.make_conversations("train", 2000, 0, plain_share=0.0)}
    held_users = {c.user for c in mtd.make_conversations("heldout", 500, 1, plain_share=0.0)}
    assert not train_users & held_users


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_final_answer_contains_what_the_evaluation_expects(split: str):
    kw = {"synthetic": 0.9, "neutral_share": 0.5} if split == "train" else {}
    for c in mtd.make_conversations(split, 500, 2, plain_share=0.0, **kw):
        assert c.tool is not None and c.result == mtd.run_tool(c.tool, c.arguments)
        assert all(s in c.answer for s in mtd.expected_in_answer(c.tool, c.result)), c


def test_list_tasks_copy_every_file():
    """`list_share` 1: every lookup becomes a file-list copy whose answer is the search_files answer of its data."""
    convs = mtd.make_conversations("train", 400, 3, synthetic=0.9, plain_share=1.0, copy_share=1.0, short_copy=True,
                                   list_share=1.0)
    lists = [c for c in convs if c.user.startswith("Data: {\"files\"")]
    assert len(lists) > 100  # about half of the copy tasks are lookups, all of them lists here
    for c in lists:
        files = json.loads(c.user[len("Data: ") : c.user.rindex("}") + 1])["files"]
        assert files and c.answer.startswith(f"I found {len(files)} file") and all(f in c.answer for f in files)
        assert not c.offer_tools and c.tool is None


def test_neutral_phrasings_name_only_the_value():
    convs = mtd.make_conversations("train", 300, 4, plain_share=0.0, neutral_share=1.0)
    stems = [p.lower().split("{x}") for p in mtd.NEUTRAL_PHRASES]
    for c in convs:  # 15% of train questions start in lower case
        user = c.user.lower()
        assert any(user.startswith(a) and user.endswith(b) for a, b in stems), c.user
        values = [str(v) for v in c.arguments.values() if v != "fahrenheit"]
        assert all(v in c.user for v in values), c
    assert len({c.tool for c in convs}) == 5
    with pytest.raises(ValueError, match="train split only"):
        mtd.make_conversations("heldout", 10, 1, neutral_share=0.5)
