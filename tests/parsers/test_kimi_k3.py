"""Tests for deltaserve.parsers.kimi_k3: XTML channels, typed tool-call arguments, malformed output, chunking."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.parsers.kimi_k3 import MAX_TAG_CHARS, KimiK3Parser
from deltaserve.parsers.types import ParsedDelta, ParsedMessage, ToolCall
from deltaserve.text.tokenizer import Tokenizer
from tests.parsers.helpers import (
    Bytes,
    Plain,
    assert_chunking_invariant,
    assert_deltas_match_message,
    build,
    one_by_one,
    parse,
    random_chunkings,
    run,
    two_cut_chunkings,
)

THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
TOOLS_OPEN, TOOLS_CLOSE = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
MESSAGE_END = "<|close|>message<|sep|><|end_of_msg|>"
# Fixture data avoids these words, so finding one in a delta means a marker (or part of one) leaked.
MARKER_TEXT = ("<|", "|>", "think", "response", "tools", "argument", "message", 'tool="', 'key="', 'type="')
FUZZ_CHUNKINGS = 150


def call(name: str, index: int, *children: str) -> str:
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>' + "".join(children) + "<|close|>call<|sep|>"


def arg(key: str, value: str, type_: str = "string") -> str:
    return f'<|open|>argument key="{key}" type="{type_}"<|sep|>{value}<|close|>argument<|sep|>'


def parse_k3(tok: Tokenizer, *parts: str | Plain | Bytes, thinking: bool = False, tools: bool = True) -> ParsedMessage:
    return parse(KimiK3Parser, tok, build(tok, *parts), thinking=thinking, tools=tools)


def tc(name: str, k: int, arguments: object) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"functions.{name}:{k}", name=name, arguments=text)


# --- channels -----------------------------------------------------------------------------------------------------


def test_thinking_off_plain_content(k3_tok: Tokenizer) -> None:
    """Thinking off: output starts inside `response`; closing markers and the stop token are dropped."""
    msg = parse_k3(k3_tok, "Hello, world.", RESPONSE_CLOSE, MESSAGE_END)
    assert msg == ParsedMessage(reasoning=None, content="Hello, world.")


def test_reasoning_then_content(k3_tok: Tokenizer) -> None:
    """Thinking on: text up to `<|close|>think<|sep|>` is reasoning, the `response` channel is content."""
    msg = parse_k3(
        k3_tok, "step one", THINK_CLOSE, RESPONSE_OPEN, "the answer", RESPONSE_CLOSE, MESSAGE_END, thinking=True
    )
    assert msg == ParsedMessage(reasoning="step one", content="the answer")


def test_thinking_on_truncated_reasoning(k3_tok: Tokenizer) -> None:
    """Output cut inside `think` is all reasoning."""
    assert parse_k3(k3_tok, "unfinished reasoning", thinking=True) == ParsedMessage(
        reasoning="unfinished reasoning", content=""
    )


def test_empty_think_channel(k3_tok: Tokenizer) -> None:
    """An empty think block gives an empty (not absent) reasoning channel."""
    msg = parse_k3(k3_tok, THINK_CLOSE, RESPONSE_OPEN, "hi", thinking=True)
    assert msg == ParsedMessage(reasoning="", content="hi")


def test_reopening_the_open_channel_is_a_no_op(k3_tok: Tokenizer) -> None:
    """A repeated `<|open|>think<|sep|>` (or `response`) at the start of output is dropped."""
    msg = parse_k3(k3_tok, "<|open|>think<|sep|>step", THINK_CLOSE, RESPONSE_OPEN, "answer", thinking=True)
    assert msg == ParsedMessage(reasoning="step", content="answer")
    assert parse_k3(k3_tok, RESPONSE_OPEN + "answer") == ParsedMessage(reasoning=None, content="answer")


def test_think_channel_with_thinking_off(k3_tok: Tokenizer) -> None:
    """A think channel the model opens on its own is still reasoning."""
    msg = parse_k3(k3_tok, RESPONSE_CLOSE, "<|open|>think<|sep|>hmm", THINK_CLOSE, RESPONSE_OPEN, "ok")
    assert msg == ParsedMessage(reasoning="hmm", content="ok")


def test_text_between_channels(k3_tok: Tokenizer) -> None:
    """Whitespace between channels is dropped; other text there is content (whole run, spaces included)."""
    msg = parse_k3(
        k3_tok, "r", THINK_CLOSE, "\n \n", RESPONSE_OPEN, "a", RESPONSE_CLOSE, " stray ", MESSAGE_END, thinking=True
    )
    assert msg == ParsedMessage(reasoning="r", content="a stray ")


def test_unknown_and_stray_markers_are_dropped(k3_tok: Tokenizer) -> None:
    """Unknown tags, closes of channels that are not open, and a lone <|sep|> reach no channel."""
    msg = parse_k3(k3_tok, 'a<|open|>foo x="1"<|sep|>b', THINK_CLOSE, "c<|sep|>d<|close|>argument<|sep|>e")
    assert msg == ParsedMessage(reasoning=None, content="abcde")


def test_marker_like_text_in_content_is_data(k3_tok: Tokenizer) -> None:
    """XTML spelled as plain text (not tokens) is content."""
    text = "literal <|close|>response<|sep|> and <|open|>tools<|sep|>"
    assert parse_k3(k3_tok, Plain(text)) == ParsedMessage(reasoning=None, content=text)


# --- tool calls -----------------------------------------------------------------------------------------------------


def test_one_tool_call(k3_tok: Tokenizer) -> None:
    """A call with a string argument, emitted with a made-up id once `<|close|>call<|sep|>` arrives."""
    msg = parse_k3(
        k3_tok,
        "need weather",
        THINK_CLOSE,
        RESPONSE_OPEN,
        "Let me check.",
        RESPONSE_CLOSE,
        TOOLS_OPEN,
        call("get_weather", 1, arg("city", "Paris")),
        TOOLS_CLOSE,
        MESSAGE_END,
        thinking=True,
    )
    assert msg == ParsedMessage(
        reasoning="need weather", content="Let me check.", tool_calls=(tc("get_weather", 0, {"city": "Paris"}),)
    )


def test_typed_arguments(k3_tok: Tokenizer) -> None:
    """String values are raw; number / boolean / null / object / array values are JSON-decoded."""
    children = (
        arg("s", " 42 "),
        arg("n", "3.5", "number"),
        arg("b", "true", "boolean"),
        arg("z", "null", "null"),
        arg("o", '{"k": [1, "é"]}', "object"),
        arg("a", "[1, 2]", "array"),
    )
    msg = parse_k3(k3_tok, TOOLS_OPEN, call("f", 1, *children), TOOLS_CLOSE)
    expected = {"s": " 42 ", "n": 3.5, "b": True, "z": None, "o": {"k": [1, "é"]}, "a": [1, 2]}
    assert msg.tool_calls == (tc("f", 0, expected),)
    assert msg.tool_calls[0].arguments == json.dumps(expected, ensure_ascii=False)


def test_invalid_typed_value_is_kept_raw(k3_tok: Tokenizer) -> None:
    """A non-string value that is not JSON becomes its raw text."""
    msg = parse_k3(k3_tok, TOOLS_OPEN, call("f", 1, arg("n", "12abc", "number")), TOOLS_CLOSE)
    assert msg.tool_calls == (tc("f", 0, {"n": "12abc"}),)


def test_json_child(k3_tok: Tokenizer) -> None:
    """A `json` child's raw text is the arguments, valid JSON or not."""
    good = '<|open|>json type="object"<|sep|> {"raw": 1} <|close|>json<|sep|>'
    bad = '<|open|>json type="object"<|sep|>not json {<|close|>json<|sep|>'
    msg = parse_k3(k3_tok, TOOLS_OPEN, call("f", 1, good), call("g", 2, bad), call("h", 3), TOOLS_CLOSE)
    assert msg.tool_calls == (tc("f", 0, '{"raw": 1}'), tc("g", 1, "not json {"), tc("h", 2, "{}"))


def test_parallel_calls(k3_tok: Tokenizer) -> None:
    """Several calls keep their order; ids number them from 0 in this output."""
    msg = parse_k3(
        k3_tok,
        TOOLS_OPEN,
        call("get_weather", 1, arg("city", "Beijing")),
        "\n",
        call("get_weather", 2, arg("city", "Shanghai")),
        call("send_email", 3, arg("to", "a@b.com"), arg("n", "2", "number")),
        TOOLS_CLOSE,
        MESSAGE_END,
    )
    assert msg.tool_calls == (
        tc("get_weather", 0, {"city": "Beijing"}),
        tc("get_weather", 1, {"city": "Shanghai"}),
        tc("send_email", 2, {"to": "a@b.com", "n": 2}),
    )
    assert msg.content == ""


def test_attribute_values_are_unescaped(k3_tok: Tokenizer) -> None:
    """`&quot;` and `&amp;` in attribute values decode to `"` and `&` (and `&amp;quot;` to `&quot;`)."""
    child = '<|open|>argument key="say &quot;hi&quot; &amp;quot;" type="string"<|sep|>v<|close|>argument<|sep|>'
    msg = parse_k3(k3_tok, TOOLS_OPEN, call("a&amp;b", 1, child), TOOLS_CLOSE)
    assert msg.tool_calls[0].name == "a&b"
    assert json.loads(msg.tool_calls[0].arguments) == {'say "hi" &quot;': "v"}


def test_arguments_with_marker_like_text(k3_tok: Tokenizer) -> None:
    """A string value holding XTML or K2 marker spellings as text is data (the upstream known limitation)."""
    value = 'x <|close|>argument<|sep|> <|close|>call<|sep|> </think> <|tool_call_end|> "q"'
    child = ['<|open|>argument key="s" type="string"<|sep|>', Plain(value), "<|close|>argument<|sep|>"]
    msg = parse_k3(k3_tok, TOOLS_OPEN, '<|open|>call tool="f" index="1"<|sep|>', *child, "<|close|>call<|sep|>")
    assert msg.tool_calls == (tc("f", 0, {"s": value}),)


def test_call_outside_tools_channel(k3_tok: Tokenizer) -> None:
    """A call opened in `response` opens the tools channel implicitly."""
    msg = parse_k3(k3_tok, "text", call("f", 1, arg("a", "1", "number")), " more")
    assert msg == ParsedMessage(reasoning=None, content="text", tool_calls=(tc("f", 0, {"a": 1}),))


def test_tools_off_drops_the_tools_channel(k3_tok: Tokenizer) -> None:
    """tools=False: the tools channel yields neither calls nor content."""
    msg = parse_k3(
        k3_tok, "ok", RESPONSE_CLOSE, TOOLS_OPEN, call("f", 1, arg("a", "x")), call("g", 2, arg("b", "trunc")),
        tools=False,
    )  # fmt: skip
    assert msg == ParsedMessage(reasoning=None, content="ok")


# --- malformed output -----------------------------------------------------------------------------------------------


def test_missing_call_close_before_next_call(k3_tok: Tokenizer) -> None:
    """A call whose children all closed is still a call when the next call (or tools close) ends it."""
    first = '<|open|>call tool="f" index="1"<|sep|>' + arg("a", "1")
    msg = parse_k3(k3_tok, TOOLS_OPEN, first, call("g", 2, arg("b", "2")), '<|open|>call tool="h"<|sep|>', TOOLS_CLOSE)
    assert msg.tool_calls == (tc("f", 0, {"a": "1"}), tc("g", 1, {"b": "2"}), tc("h", 2, {}))


def test_call_close_accepts_open_argument(k3_tok: Tokenizer) -> None:
    """`<|close|>call<|sep|>` with an argument still open takes that argument as complete."""
    msg = parse_k3(
        k3_tok, TOOLS_OPEN, '<|open|>call tool="f"<|sep|><|open|>argument key="a"<|sep|>v<|close|>call<|sep|>'
    )
    assert msg.tool_calls == (tc("f", 0, {"a": "v"}),)


def test_truncated_inside_argument_degrades_to_content(k3_tok: Tokenizer) -> None:
    """Output cut inside an argument: no call; the call's value text goes to content; no marker leaks."""
    ids = build(
        k3_tok, "Sure.", RESPONSE_CLOSE, TOOLS_OPEN, call("f", 1, arg("a", "1")), '<|open|>call tool="g"<|sep|>'
    )
    ids += build(k3_tok, arg("x", "done"), '<|open|>argument key="code" type="string"<|sep|>print(1')
    for chunks in ([ids], one_by_one(ids)):
        parser = KimiK3Parser(k3_tok, thinking=False, tools=True)
        streamed = run(parser, chunks)
        assert parser.message == ParsedMessage(
            reasoning=None, content="Sure.doneprint(1", tool_calls=(tc("f", 0, {"a": "1"}),)
        )
        assert_deltas_match_message(streamed, parser.message)


def test_truncated_between_arguments_is_a_call(k3_tok: Tokenizer) -> None:
    """Output cut after a call's last child closed: finish() emits the call."""
    msg = parse_k3(k3_tok, TOOLS_OPEN, '<|open|>call tool="f" index="1"<|sep|>', arg("a", "1", "number"))
    assert msg.tool_calls == (tc("f", 0, {"a": 1}),)


def test_truncated_inside_a_marker(k3_tok: Tokenizer) -> None:
    """Output cut between `<|close|>` and `<|sep|>` drops the partial marker."""
    for tail in ("<|close|>resp", "<|open|>", '<|open|>call tool="f'):
        parser = KimiK3Parser(k3_tok, thinking=False, tools=True)
        streamed = run(parser, one_by_one(build(k3_tok, "answer", tail)))
        assert parser.message == ParsedMessage(reasoning=None, content="answer")
        assert streamed.content == "answer"


def test_call_without_tool_name_degrades_to_content(k3_tok: Tokenizer) -> None:
    """A call with no `tool` attribute is not a call; its values go to content."""
    msg = parse_k3(k3_tok, TOOLS_OPEN, '<|open|>call index="1"<|sep|>', arg("a", "v"), "<|close|>call<|sep|>")
    assert msg == ParsedMessage(reasoning=None, content="v")


def test_interrupted_marker_is_dropped(k3_tok: Tokenizer) -> None:
    """An `<|open|>` followed by another `<|open|>` before `<|sep|>` is dropped; the second one counts."""
    msg = parse_k3(k3_tok, "a<|open|>resp<|open|>think<|sep|>r", thinking=False)
    assert msg == ParsedMessage(reasoning="r", content="a")


def test_overlong_marker_text_is_text_again(k3_tok: Tokenizer) -> None:
    """After MAX_TAG_CHARS without `<|sep|>`, the would-be tag text is channel text (the token is dropped)."""
    long = "z" * (MAX_TAG_CHARS + 10)
    ids = build(k3_tok, "a<|open|>", long, "b")
    msg = assert_chunking_invariant(
        KimiK3Parser, k3_tok, ids, [one_by_one(ids), two_cut_chunkings(ids)[len(ids) // 2]], thinking=False, tools=True
    )
    assert msg == ParsedMessage(reasoning=None, content="a" + long + "b")


def test_k2_tokenizer_is_rejected(k2_tok: Tokenizer) -> None:
    """Without <|open|> / <|close|> / <|sep|> tokens the K3 parser cannot work: a clear constructor error."""
    with pytest.raises(ValueError, match="K3"):
        KimiK3Parser(k2_tok, thinking=True, tools=True)


# --- streaming ------------------------------------------------------------------------------------------------------


def test_tool_call_streams_as_one_delta_at_close(k3_tok: Tokenizer) -> None:
    """Token by token, a call appears only at its close marker, whole: id, name and all arguments in one delta."""
    ids = build(k3_tok, TOOLS_OPEN, call("get_weather", 1, arg("city", "Paris"), arg("days", "3", "number")))
    streamed = run(KimiK3Parser(k3_tok, thinking=False, tools=True), one_by_one(ids))
    with_calls = [d for d in streamed.deltas if d.tool_calls]
    assert len(with_calls) == 1
    (delta,) = with_calls[0].tool_calls
    assert (delta.index, delta.id, delta.name) == (0, "functions.get_weather:0", "get_weather")
    assert json.loads(delta.arguments) == {"city": "Paris", "days": 3}
    assert streamed.deltas[-2] is with_calls[0]  # emitted by the push of the last id, not held to finish()


def test_utf8_split_characters(k3_tok: Tokenizer) -> None:
    """A character whose bytes span tokens never yields U+FFFD mid-stream, in any channel."""
    ids = build(k3_tok, Bytes("é中"), THINK_CLOSE, RESPONSE_OPEN, Bytes("😀 ok"), RESPONSE_CLOSE, TOOLS_OPEN)
    ids += build(k3_tok, '<|open|>call tool="f"<|sep|><|open|>argument key="s" type="string"<|sep|>', Bytes("ß🎉"))
    ids += build(k3_tok, "<|close|>argument<|sep|><|close|>call<|sep|>")
    parser = KimiK3Parser(k3_tok, thinking=True, tools=True)
    streamed = run(parser, one_by_one(ids))
    for delta in streamed.deltas:
        assert "\ufffd" not in delta.reasoning + delta.content + "".join(t.arguments for t in delta.tool_calls)
    assert parser.message == ParsedMessage(reasoning="é中", content="😀 ok", tool_calls=(tc("f", 0, {"s": "ß🎉"}),))


FIXTURES = {
    "reasoning-content-calls": (
        True,
        (
            "Plan: look up the weather, café 😀.",
            THINK_CLOSE,
            "\n",
            RESPONSE_OPEN,
            "Sure, checking.",
            RESPONSE_CLOSE,
            TOOLS_OPEN,
            call("get_weather", 1, arg("city", "Paris"), arg("days", "3", "number")),
            call("lookup", 2, '<|open|>json type="object"<|sep|>{"q": [1, 2]}<|close|>json<|sep|>'),
            TOOLS_CLOSE,
            MESSAGE_END,
        ),
    ),
    "content-only": (False, ("Hello there, 天地玄黄。", RESPONSE_CLOSE, " x ", MESSAGE_END)),
    "malformed-truncated": (
        True,
        (
            "r",
            THINK_CLOSE,
            "stray",
            '<|open|>resp<|open|>response<|sep|>a<|open|>call tool="f"<|sep|>',
            arg("k", "v"),
            '<|open|>call index="2"<|sep|>',
            arg("k", "w"),
            "<|close|>call<|sep|>",
            call("g", 3, arg("n", "1", "number")),
            '<|open|>call tool="h"<|sep|><|open|>argument key="c" type="string"<|sep|>cut he',
        ),
    ),
}


def test_fixture_messages(k3_tok: Tokenizer) -> None:
    """The chunking fixtures parse to the intended messages (so the invariance tests check something real)."""
    msgs = {name: parse_k3(k3_tok, *parts, thinking=thinking) for name, (thinking, parts) in FIXTURES.items()}
    assert msgs["reasoning-content-calls"] == ParsedMessage(
        reasoning="Plan: look up the weather, café 😀.",
        content="Sure, checking.",
        tool_calls=(tc("get_weather", 0, {"city": "Paris", "days": 3}), tc("lookup", 1, '{"q": [1, 2]}')),
    )
    assert msgs["content-only"] == ParsedMessage(reasoning=None, content="Hello there, 天地玄黄。 x ")
    assert msgs["malformed-truncated"] == ParsedMessage(
        reasoning="r",
        content="strayawcut he",
        tool_calls=(tc("f", 0, {"k": "v"}), tc("g", 1, {"n": 1})),
    )


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_two_push_split_matches_one_shot(k3_tok: Tokenizer, name: str) -> None:
    """For every cut of the ids into two pushes, the deltas join to the one-shot message; no marker text leaks."""
    thinking, parts = FIXTURES[name]
    ids = build(k3_tok, *parts)
    chunkings = [*two_cut_chunkings(ids), one_by_one(ids)]
    assert_chunking_invariant(
        KimiK3Parser, k3_tok, ids, chunkings, forbidden=MARKER_TEXT, thinking=thinking, tools=True
    )


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("tools", [True, False])
def test_random_chunkings_match_one_shot(k3_tok: Tokenizer, name: str, tools: bool) -> None:
    """Many random chunkings (fixed seed) stream exactly the one-shot message."""
    thinking, parts = FIXTURES[name]
    ids = build(k3_tok, *parts)
    rng = random.Random(f"k3-{name}-{tools}")
    assert_chunking_invariant(
        KimiK3Parser,
        k3_tok,
        ids,
        random_chunkings(ids, rng, FUZZ_CHUNKINGS),
        forbidden=MARKER_TEXT,
        thinking=thinking,
        tools=tools,
    )


def test_random_token_soup_never_raises(k3_tok: Tokenizer) -> None:
    """Random ids (markers, tags, specials, text, out-of-vocab) never raise and stream the one-shot message."""
    rng = random.Random(11)
    pieces = [build(k3_tok, p) for p in ("<|open|>", "<|close|>", "<|sep|>", "think", "response", "tools", "call")]
    pieces += [build(k3_tok, p) for p in (' tool="f"', "argument", ' key="k" type="number"', "json", "1", "[EOS]")]
    for _ in range(150):
        ids: list[int] = []
        while len(ids) < 40:
            ids += rng.choice(pieces) if rng.random() < 0.7 else [rng.randrange(k3_tok.vocab_size + 5)]
        for thinking in (False, True):
            assert_chunking_invariant(
                KimiK3Parser, k3_tok, ids, random_chunkings(ids, rng, 3), thinking=thinking, tools=True
            )


def test_push_after_finish_raises_and_finish_is_idempotent(k3_tok: Tokenizer) -> None:
    """finish() twice is harmless; push() after finish() is a caller bug."""
    parser = KimiK3Parser(k3_tok, thinking=True, tools=True)
    run(parser, [build(k3_tok, "hi")])
    assert parser.finish() == ParsedDelta()
    with pytest.raises(RuntimeError):
        parser.push([1])
