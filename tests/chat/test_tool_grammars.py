"""Tool-call grammars of both formats, run for real with llguidance on the tiny tokenizers.

Properties: the rendered history turn of a correct call (minus the generation prompt) is accepted and ends the
turn; wrong names, schema violations, extra calls and wrong indices are rejected; seeded random walks through
the token masks always yield calls that parse and validate against the tool's JSON schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from deltaserve.chat import ChatMessage, ToolSpec
from deltaserve.chat.format import ChatFormat
from deltaserve.parsers.types import ToolCall
from tests.chat.conftest import VOCAB
from tests.chat.walk import accepts, allowed, matcher, parse_k2_calls, parse_k3_calls, random_walk

TOOLS = (
    ToolSpec(
        name="get_weather",
        description="Weather for a city",
        parameters={
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", 'Rome "old"']},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "note": {"type": "string", "maxLength": 8},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="set_alarm",
        parameters={
            "type": "object",
            "properties": {
                "on": {"type": "boolean"},
                "label": {"type": ["string", "null"], "maxLength": 5},
                "repeat": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
            },
            "required": ["on"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(name="ping", parameters={"type": "object", "properties": {}, "additionalProperties": False}),
)
BY_NAME = {t.name: t for t in TOOLS}
PARSERS = {"kimi_k2": parse_k2_calls, "kimi_k3": parse_k3_calls}


@pytest.fixture(params=["kimi_k2", "kimi_k3"])
def fmt_ll(request, k2, k3, k2_ll, k3_ll):
    return (k2, k2_ll) if request.param == "kimi_k2" else (k3, k3_ll)


def output_ids(fmt: ChatFormat, calls: list[tuple[str, dict | str]], *, thinking: bool, reasoning: str = "") -> list:
    """What the model emits for these calls: the rendered assistant history turn minus the generation prompt."""
    tool_calls = tuple(
        ToolCall(id=f"functions.{name}:{k}", name=name, arguments=a if isinstance(a, str) else json.dumps(a))
        for k, (name, a) in enumerate(calls)
    )
    turn = ChatMessage(role="assistant", reasoning=reasoning, tool_calls=tool_calls)
    full = fmt.render([turn], thinking=thinking, add_generation_prompt=False)
    prompt = fmt.render([], thinking=thinking)
    assert full[: len(prompt)] == prompt
    return full[len(prompt) :]


GOOD = [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
def test_rendered_call_is_accepted_and_ends_the_turn(fmt_ll, thinking: bool) -> None:
    """The ids of a correct call (as the history would render it) are accepted, and the last one ends the turn."""
    fmt, ll = fmt_ll
    grammar = fmt.tool_call_grammar(TOOLS, name=None, parallel=False, thinking=thinking)
    ids = output_ids(fmt, GOOD, thinking=thinking, reasoning="Let me check." if thinking else "")
    assert ids[-1] in fmt.stop_token_ids
    m = matcher(ll, grammar)
    assert m.consume_tokens(ids[:-1]) and not m.is_accepting()
    assert ids[-1] in {int(i) for i in allowed(m, VOCAB)}
    assert m.consume_token(ids[-1]) and m.is_accepting() and m.is_stopped()
    args = {"city": 'Rome "old"', "days": 7, "note": "<|x|> &"}
    assert accepts(ll, grammar, output_ids(fmt, [("get_weather", args)], thinking=thinking))
    assert accepts(ll, grammar, output_ids(fmt, [("ping", {})], thinking=thinking))
    alarm = {"on": False, "label": None, "repeat": ["tue"]}
    assert accepts(ll, grammar, output_ids(fmt, [("set_alarm", alarm)], thinking=thinking))


BAD_CALLS = {
    "unknown tool": [("get_time", {"city": "Paris", "days": 3})],
    "enum violated": [("get_weather", {"city": "Lima", "days": 3})],
    "integer above maximum": [("get_weather", {"city": "Paris", "days": 9})],
    "integer as string": [("get_weather", {"city": "Paris", "days": "3"})],
    "string too long": [("get_weather", {"city": "Paris", "days": 3, "note": "much too long"})],
    "missing required": [("get_weather", {"days": 3})],
    "extra property": [("get_weather", {"city": "Paris", "days": 3, "x": 1})],
    "wrong type": [("set_alarm", {"on": "yes"})],
    "two calls without parallel": GOOD + GOOD,
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_invalid_calls_are_rejected(fmt_ll, case: str) -> None:
    """Calls to unknown tools or with arguments violating the schema never complete the grammar."""
    fmt, ll = fmt_ll
    grammar = fmt.tool_call_grammar(TOOLS, name=None, parallel=False, thinking=False)
    assert not accepts(ll, grammar, output_ids(fmt, BAD_CALLS[case], thinking=False))


def test_parallel_and_forced_name(fmt_ll) -> None:
    """parallel admits several calls with consecutive indices; a forced name admits only that tool."""
    fmt, ll = fmt_ll
    two = GOOD + [("set_alarm", {"on": True})]
    parallel = fmt.tool_call_grammar(TOOLS, name=None, parallel=True, thinking=False)
    assert accepts(ll, parallel, output_ids(fmt, two, thinking=False))
    assert accepts(ll, parallel, output_ids(fmt, GOOD, thinking=False))
    forced = fmt.tool_call_grammar(TOOLS, name="set_alarm", parallel=True, thinking=False)
    assert not accepts(ll, forced, output_ids(fmt, two, thinking=False))
    assert accepts(ll, forced, output_ids(fmt, two[1:] * 2, thinking=False))
    with pytest.raises(ValueError, match="not among the offered tools"):
        fmt.tool_call_grammar(TOOLS, name="nope", parallel=False, thinking=False)
    with pytest.raises(ValueError, match="at least one tool"):
        fmt.tool_call_grammar((), name=None, parallel=False, thinking=False)


def test_call_indices_and_reasoning_are_enforced(fmt_ll) -> None:
    """A call numbered out of turn order is refused; thinking grammars need the reasoning closed, plain ones refuse
    reasoning."""
    fmt, ll = fmt_ll
    plain = fmt.tool_call_grammar(TOOLS, name=None, parallel=True, thinking=False)
    ids = output_ids(fmt, GOOD, thinking=False)
    text = fmt.tokenizer.decode(ids)
    shifted = text.replace("get_weather:0", "get_weather:1").replace('index="1"', 'index="2"')
    assert shifted != text and not accepts(ll, plain, fmt.tokenizer.encode(shifted))
    thinking = fmt.tool_call_grammar(TOOLS, name=None, parallel=False, thinking=True)
    assert not accepts(ll, thinking, ids)
    assert not accepts(ll, plain, output_ids(fmt, GOOD, thinking=True, reasoning="hmm"))
    assert accepts(ll, thinking, output_ids(fmt, GOOD, thinking=True, reasoning=""))


@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
@pytest.mark.parametrize("name", [None, "set_alarm"], ids=["any", "forced"])
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_random_walk_yields_valid_calls(fmt_ll, thinking: bool, name: str | None, parallel: bool) -> None:
    """Seeded random walks through the masks end the turn with calls that parse and validate."""
    fmt, ll = fmt_ll
    grammar = fmt.tool_call_grammar(TOOLS, name=name, parallel=parallel, thinking=thinking)
    specials = frozenset(fmt.tokenizer.special_tokens.values())
    first = 0 if fmt.name == "kimi_k2" else 1
    for seed in range(4):
        m = matcher(ll, grammar)
        ids = random_walk(m, VOCAB, seed, specials=specials, max_tokens=1000)
        assert m.is_stopped() and m.is_accepting(), fmt.tokenizer.decode(ids)
        assert ids[-1] in fmt.stop_token_ids
        calls = PARSERS[fmt.name](fmt.tokenizer, ids, thinking=thinking)
        assert [index for _, index, _ in calls] == list(range(first, first + len(calls)))
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for tool, _, arguments in calls:
            assert name is None or tool == name
            jsonschema.validate(arguments, BY_NAME[tool].parameters)
