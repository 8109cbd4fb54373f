"""Answer constraints (response_format) wrapped into each format's channels, run with llguidance."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deltaserve.chat import ChatMessage
from deltaserve.chat.format import ChatFormat
from deltaserve.sampling_params import StructuredOutput
from tests.chat.conftest import VOCAB
from tests.chat.walk import accepts, matcher, pieces, random_walk

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}, "why": {"enum": ["a", "b"]}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}
CASES = {
    "json_schema": (StructuredOutput("json_schema", json.dumps(SCHEMA)), '{"answer": 3, "why": "a"}', '{"answer": 12}'),
    "json_object": (StructuredOutput("json_object"), '{"k": [1, "x"]}', "[1]"),
    "regex": (StructuredOutput("regex", r"[a-c]{2}\d"), "ab7", "ad7"),
    "lark": (StructuredOutput("lark", 'start: "yes" | "no" | braces\nbraces: "{" "}"'), "{}", "maybe"),
}


@pytest.fixture(params=["kimi_k2", "kimi_k3"])
def fmt_ll(request, k2, k3, k2_ll, k3_ll):
    return (k2, k2_ll) if request.param == "kimi_k2" else (k3, k3_ll)


def answer_ids(fmt: ChatFormat, content: str, *, thinking: bool, reasoning: str = "") -> list[int]:
    """The rendered assistant history turn holding `content`, minus the generation prompt."""
    turn = ChatMessage(role="assistant", content=content, reasoning=reasoning)
    # A lone plain K2 turn counts as history and renders `<think></think>`: put the reasoning back in, as emitted.
    full = fmt.render([turn], thinking=thinking, add_generation_prompt=False)
    if fmt.name == "kimi_k2" and thinking:
        think_end = fmt.tokenizer.special_tokens["</think>"]
        full = full[: full.index(think_end)] + fmt.tokenizer.encode(reasoning) + full[full.index(think_end) :]
    prompt = fmt.render([], thinking=thinking)
    assert full[: len(prompt)] == prompt
    return full[len(prompt) :]


@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
@pytest.mark.parametrize("kind", list(CASES))
def test_answer_is_constrained_inside_the_channels(fmt_ll, kind: str, thinking: bool) -> None:
    """A matching answer, framed as the history would render it, is accepted; a non-matching one is not."""
    fmt, ll = fmt_ll
    structured, good, bad = CASES[kind]
    grammar = fmt.constrain(structured, thinking=thinking)
    reasoning = "Think first." if thinking else ""
    ids = answer_ids(fmt, good, thinking=thinking, reasoning=reasoning)
    assert ids[-1] in fmt.stop_token_ids
    assert accepts(ll, grammar, ids)
    assert not accepts(ll, grammar, ids[:-1])
    assert not accepts(ll, grammar, answer_ids(fmt, bad, thinking=thinking, reasoning=reasoning))
    if thinking:
        assert not accepts(ll, grammar, answer_ids(fmt, good, thinking=False))


@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
def test_random_walk_answers_validate(fmt_ll, thinking: bool) -> None:
    """Random walks through a json_schema constraint end the turn with JSON valid for the schema."""
    fmt, ll = fmt_ll
    grammar = fmt.constrain(CASES["json_schema"][0], thinking=thinking)
    specials = frozenset(fmt.tokenizer.special_tokens.values())
    for seed in range(4):
        m = matcher(ll, grammar)
        ids = random_walk(m, VOCAB, seed, specials=specials, max_tokens=400)
        assert m.is_stopped() and ids[-1] in fmt.stop_token_ids, fmt.tokenizer.decode(ids)
        texts = [p for p in pieces(fmt.tokenizer, ids) if isinstance(p, str)]
        answer = texts[-1] if fmt.name == "kimi_k2" else texts[-3]  # K3: answer, then "response", "message"
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_constrain_refuses_bad_specs(k2) -> None:
    """A json_schema spec that is not JSON is refused with a clear error."""
    with pytest.raises(ValueError, match="not valid JSON"):
        k2.constrain(StructuredOutput("json_schema", "{nope"), thinking=False)
