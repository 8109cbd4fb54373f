"""Tests for deltaserve.parsers.kimi_k2: channels, tool calls, malformed output and chunking invariance."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.parsers.kimi_k2 import KimiK2Parser
from deltaserve.parsers.types import ParsedDelta, ParsedMessage, ToolCall
from deltaserve.text.tokenizer import Tokenizer
from tests.parsers.helpers import (
    Bytes,
    Plain,
    assert_chunking_invariant,
    assert_deltas_match_message,
    assert_no_marker_text,
    build,
    one_by_one,
    parse,
    random_chunkings,
    run,
    two_cut_chunkings,
)

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKER_TEXT = ("<|", "|>", "<think", "</think", "</thinking")
FUZZ_CHUNKINGS = 150


def call(header: str, args: str) -> str:
    return f"{CB}{header}{AB}{args}{CE}"


def section(*calls: str) -> str:
    return SB + "".join(calls) + SE


def parse_k2(tok: Tokenizer, *parts: str | Plain | Bytes, thinking: bool = False, tools: bool = True) -> ParsedMessage:
    return parse(KimiK2Parser, tok, build(tok, *parts), thinking=thinking, tools=tools)


def tc(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


# --- channels -----------------------------------------------------------------------------------------------------


def test_plain_content_thinking_off(k2_tok: Tokenizer) -> None:
    """Without thinking, output is content and the message has no reasoning channel."""
    msg = parse_k2(k2_tok, "Hello, world. The answer is 42.<|im_end|>")
    assert msg == ParsedMessage(reasoning=None, content="Hello, world. The answer is 42.")


def test_reasoning_then_content(k2_tok: Tokenizer) -> None:
    """With thinking, text before </think> is reasoning, after it content; the stop token is dropped."""
    msg = parse_k2(k2_tok, "Let me think.</think>The answer is 42.<|im_end|>", thinking=True)
    assert msg == ParsedMessage(reasoning="Let me think.", content="The answer is 42.")


def test_thinking_on_truncated_reasoning(k2_tok: Tokenizer) -> None:
    """Output cut inside the reasoning is all reasoning."""
    msg = parse_k2(k2_tok, "still thinking about", thinking=True)
    assert msg == ParsedMessage(reasoning="still thinking about", content="")


def test_thinking_on_empty_output(k2_tok: Tokenizer) -> None:
    """An empty output with thinking on has an empty (not absent) reasoning channel."""
    assert parse_k2(k2_tok, thinking=True) == ParsedMessage(reasoning="", content="")
    assert parse_k2(k2_tok, "[EOS]", thinking=False) == ParsedMessage(reasoning=None, content="")


def test_repeated_think_open_is_ignored(k2_tok: Tokenizer) -> None:
    """A <think> the model repeats at the start of its output does not leak or reset anything."""
    msg = parse_k2(k2_tok, "<think>step one</think>final answer", thinking=True)
    assert msg == ParsedMessage(reasoning="step one", content="final answer")


def test_think_block_with_thinking_off(k2_tok: Tokenizer) -> None:
    """A <think> token in content opens reasoning even when the prompt did not."""
    msg = parse_k2(k2_tok, "<think>hmm</think>answer", thinking=False)
    assert msg == ParsedMessage(reasoning="hmm", content="answer")


def test_hallucinated_thinking_close_text(k2_tok: Tokenizer) -> None:
    """The text `</thinking>` ends reasoning like </think>; it is not emitted."""
    msg = parse_k2(k2_tok, "step by step</thinking>final", thinking=True)
    assert msg == ParsedMessage(reasoning="step by step", content="final")


def test_thinking_close_text_in_content_is_data(k2_tok: Tokenizer) -> None:
    """After reasoning ended, `</thinking>` and `<think>` written as text are ordinary content."""
    msg = parse_k2(k2_tok, "r</think>", Plain("use <think> and </thinking> tags"), thinking=True)
    assert msg == ParsedMessage(reasoning="r", content="use <think> and </thinking> tags")


def test_stray_markers_are_dropped(k2_tok: Tokenizer) -> None:
    """Markers that mean nothing where they appear, and non-marker specials, never reach a channel."""
    msg = parse_k2(k2_tok, "[BOS]a</think>b<|im_middle|>c" + SE + "d[EOT]", thinking=False)
    assert msg == ParsedMessage(reasoning=None, content="abcd")


# --- tool calls -----------------------------------------------------------------------------------------------------


def test_one_tool_call(k2_tok: Tokenizer) -> None:
    """Reasoning, content, then one call: id = header, name after the last '.', raw JSON arguments."""
    msg = parse_k2(
        k2_tok,
        "I need the weather.</think>I'll check. ",
        section(call("functions.get_weather:0", '{"city": "Paris"}')),
        "<|im_end|>",
        thinking=True,
    )
    assert msg == ParsedMessage(
        reasoning="I need the weather.",
        content="I'll check. ",
        tool_calls=(tc("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),),
    )


def test_tool_section_ends_reasoning(k2_tok: Tokenizer) -> None:
    """<|tool_calls_section_begin|> ends reasoning implicitly."""
    msg = parse_k2(k2_tok, "plan", section(call("functions.f:0", "{}")), thinking=True)
    assert msg == ParsedMessage(reasoning="plan", content="", tool_calls=(tc("functions.f:0", "f", "{}"),))


def test_bare_call_begin_opens_section(k2_tok: Tokenizer) -> None:
    """A <|tool_call_begin|> without a section begin still starts a call (and ends reasoning)."""
    msg = parse_k2(k2_tok, "plan", call("functions.f:0", '{"a": 1}'), "after", thinking=True)
    assert msg == ParsedMessage(reasoning="plan", content="", tool_calls=(tc("functions.f:0", "f", '{"a": 1}'),))


def test_parallel_calls(k2_tok: Tokenizer) -> None:
    """Several calls in one section keep their order, ids and arguments."""
    msg = parse_k2(
        k2_tok,
        "Compare. ",
        section(
            call("functions.get_weather:0", '{"city": "Beijing"}'),
            call("functions.get_weather:1", '{"city": "Shanghai"}'),
            call("functions.send_email:2", '{"to": "a@b.com", "subject": "Daily"}'),
        ),
    )
    assert msg.content == "Compare. "
    assert msg.tool_calls == (
        tc("functions.get_weather:0", "get_weather", '{"city": "Beijing"}'),
        tc("functions.get_weather:1", "get_weather", '{"city": "Shanghai"}'),
        tc("functions.send_email:2", "send_email", '{"to": "a@b.com", "subject": "Daily"}'),
    )


def test_content_after_section_is_content(k2_tok: Tokenizer) -> None:
    """Text after <|tool_calls_section_end|> is content again."""
    msg = parse_k2(k2_tok, "Before. ", section(call("functions.f:0", "{}")), " After.")
    assert msg.content == "Before.  After."
    assert len(msg.tool_calls) == 1


def test_noise_between_calls_is_dropped(k2_tok: Tokenizer) -> None:
    """Whitespace or stray text inside the section but outside calls reaches no channel."""
    msg = parse_k2(
        k2_tok, "A", SB, "\n noise ", call("functions.f:0", "{}"), "\n", call("functions.g:1", "{}"), "\n", SE
    )
    assert msg.content == "A"
    assert [c.name for c in msg.tool_calls] == ["f", "g"]


def test_argument_and_header_whitespace_is_stripped(k2_tok: Tokenizer) -> None:
    """Whitespace around the header and the arguments is not part of the id or the arguments."""
    msg = parse_k2(k2_tok, SB, CB, " functions.get_weather:0 ", AB, ' \n{"city": "A"} \n', CE, SE)
    assert msg.tool_calls == (tc("functions.get_weather:0", "get_weather", '{"city": "A"}'),)


def test_arguments_with_marker_like_text(k2_tok: Tokenizer) -> None:
    """Marker spellings inside the arguments are data: only the special-token ids are markers."""
    args = json.dumps({"text": "a <|tool_call_end|> b <|tool_calls_section_end|> </think> </thinking> <think>"})
    singular = '{"s": "<|tool_call_section_end|>"}'
    msg = parse_k2(
        k2_tok,
        "r</think>",
        SB,
        CB,
        "functions.echo:0",
        AB,
        Plain(args),
        CE,
        CB,
        "functions.echo:1",
        AB,
        Plain(singular),
        CE,
        SE,
        thinking=True,
    )
    assert msg.tool_calls == (tc("functions.echo:0", "echo", args), tc("functions.echo:1", "echo", singular))
    assert msg.content == "" and msg.reasoning == "r"


def test_marker_like_text_in_reasoning_and_content(k2_tok: Tokenizer) -> None:
    """`<|tool_calls_section_begin|>` as plain text is data; only the token opens the section."""
    msg = parse_k2(k2_tok, Plain("the <|tool_calls_section_begin|> token"), thinking=False)
    assert msg == ParsedMessage(reasoning=None, content="the <|tool_calls_section_begin|> token")


def test_singular_section_spelling_as_text(k2_tok: Tokenizer) -> None:
    """The singular `<|tool_call_section_begin|>` / `_end|>` text (not a token) delimits a section too."""
    msg = parse_k2(
        k2_tok,
        Plain("ok <|tool_call_section_begin|>"),
        call("functions.f:0", '{"x": 1}'),
        Plain("<|tool_call_section_end|> done"),
    )
    assert msg == ParsedMessage(reasoning=None, content="ok  done", tool_calls=(tc("functions.f:0", "f", '{"x": 1}'),))


def test_empty_arguments_become_empty_object(k2_tok: Tokenizer) -> None:
    """A call with no argument text gets `{}`, streamed as its only argument piece."""
    ids = build(k2_tok, section(call("functions.ping:0", "")))
    streamed = run(KimiK2Parser(k2_tok, thinking=False, tools=True), one_by_one(ids))
    assert streamed.tool_calls() == (tc("functions.ping:0", "ping", "{}"),)


def test_tools_off_drops_the_section(k2_tok: Tokenizer) -> None:
    """tools=False: the section (calls included) reaches no channel, but still ends reasoning."""
    msg = parse_k2(k2_tok, "plan", section(call("functions.f:0", '{"a": 1}')), " after", thinking=True, tools=False)
    assert msg == ParsedMessage(reasoning="plan", content=" after")


# --- malformed output -----------------------------------------------------------------------------------------------


def test_invalid_json_arguments_pass_through(k2_tok: Tokenizer) -> None:
    """A complete call with invalid JSON is still a call; its arguments text is raw."""
    msg = parse_k2(k2_tok, section(call("functions.bad:0", '{"city": "Bei'), call("functions.good:1", "{}")))
    assert msg.tool_calls == (tc("functions.bad:0", "bad", '{"city": "Bei'), tc("functions.good:1", "good", "{}"))


def test_malformed_header_degrades_to_content(k2_tok: Tokenizer) -> None:
    """A header that is not NAME:IDX makes no call; the call's text (header, arguments) goes to content."""
    msg = parse_k2(
        k2_tok,
        "Help. ",
        section(call("functions.invalid.0", '{"a": 1}'), call("functions.valid:1", '{"b": 2}')),
    )
    assert msg.tool_calls == (tc("functions.valid:1", "valid", '{"b": 2}'),)
    assert msg.content == 'Help. functions.invalid.0{"a": 1}'


def test_header_without_argument_marker(k2_tok: Tokenizer) -> None:
    """A header closed by the next call (or the call end) without an argument marker degrades to content."""
    msg = parse_k2(
        k2_tok, SB, CB, "functions.read_file:0", call("functions.get_weather:1", '{"city": "Oslo"}'), CB, "x:2", CE, SE
    )
    assert msg.tool_calls == (tc("functions.get_weather:1", "get_weather", '{"city": "Oslo"}'),)
    assert msg.content == "functions.read_file:0x:2"


def test_overlong_header_degrades_without_waiting(k2_tok: Tokenizer) -> None:
    """Header text beyond MAX_HEADER_CHARS is streamed as content before the call ends."""
    junk = "word " * 200
    parser = KimiK2Parser(k2_tok, thinking=False, tools=True)
    delta = parser.push(build(k2_tok, SB, CB, junk))
    assert delta.content.startswith("word word") and not delta.tool_calls
    parser.push(build(k2_tok, AB, "{}", CE, SE))
    parser.finish()
    assert parser.message == ParsedMessage(reasoning=None, content=junk + "{}")


def test_truncated_arguments_are_kept_as_a_call(k2_tok: Tokenizer) -> None:
    """Output cut inside the arguments: the (already announced) call keeps the partial arguments; no marker leaks."""
    ids = build(k2_tok, "I'll check. ", SB, CB, "functions.get_weather:0", AB, '{"city": "Bei')
    for chunks in ([ids], one_by_one(ids)):
        streamed = run(KimiK2Parser(k2_tok, thinking=False, tools=True), chunks)
        assert streamed.content == "I'll check. "
        assert streamed.tool_calls() == (tc("functions.get_weather:0", "get_weather", '{"city": "Bei'),)
        assert_no_marker_text(streamed, MARKER_TEXT)


def test_truncated_header_is_dropped(k2_tok: Tokenizer) -> None:
    """Output cut (max_tokens) inside a header: no call, and the header is tool markup, not content (it once leaked
    as 'functions.get_weather:0' in the answer of a length finish)."""
    msg = parse_k2(k2_tok, "A", SB, call("functions.f:0", "{}"), CB, "functions.g")
    assert msg == ParsedMessage(reasoning=None, content="A", tool_calls=(tc("functions.f:0", "f", "{}"),))
    ids = build(k2_tok, "A", SB, CB, "functions.get_weather:0")
    for chunks in ([ids], one_by_one(ids)):
        streamed = run(KimiK2Parser(k2_tok, thinking=False, tools=True), chunks)
        assert streamed.content == "A" and not streamed.tool_calls()


def test_missing_section_end(k2_tok: Tokenizer) -> None:
    """A section that never ends keeps its complete calls; stop tokens after them are dropped."""
    msg = parse_k2(k2_tok, SB, call("functions.f:0", '{"a": 1}'), "<|im_end|>")
    assert msg == ParsedMessage(reasoning=None, content="", tool_calls=(tc("functions.f:0", "f", '{"a": 1}'),))


def test_missing_call_end_before_section_end(k2_tok: Tokenizer) -> None:
    """<|tool_calls_section_end|> inside the arguments ends the call and the section."""
    msg = parse_k2(k2_tok, SB, CB, "functions.f:0", AB, '{"a": 1} ', SE, "tail")
    assert msg == ParsedMessage(reasoning=None, content="tail", tool_calls=(tc("functions.f:0", "f", '{"a": 1}'),))


def test_truncated_partial_text_marker_is_flushed(k2_tok: Tokenizer) -> None:
    """A text that only starts like `</thinking>` at the end of output is reasoning text, flushed by finish()."""
    parser = KimiK2Parser(k2_tok, thinking=True, tools=True)
    first = parser.push(build(k2_tok, "a </thin"))
    assert first.reasoning == "a "  # the possible marker start is held
    assert parser.finish() == ParsedDelta(reasoning="</thin")
    assert parser.message == ParsedMessage(reasoning="a </thin", content="")


# --- streaming ------------------------------------------------------------------------------------------------------


def test_argument_diffs_concatenate_to_arguments(k2_tok: Tokenizer) -> None:
    """Token-by-token: id and name come once, then argument pieces that join to the final arguments."""
    args = '{"city": "Paris", "days": [1, 2, 3], "note": "x y z"}'
    ids = build(k2_tok, "Hi. ", section(call("functions.get_weather:0", args), call("functions.f:1", "{}")))
    streamed = run(KimiK2Parser(k2_tok, thinking=False, tools=True), one_by_one(ids))
    first_pieces = [d.tool_calls[0] for d in streamed.deltas if d.tool_calls and d.tool_calls[0].index == 0]
    assert first_pieces[0].name == "get_weather" and first_pieces[0].id == "functions.get_weather:0"
    assert len([p for p in first_pieces if p.arguments]) > 3  # really streamed, not sent whole
    assert "".join(p.arguments for p in first_pieces) == args
    assert streamed.tool_calls()[0].arguments == args


def test_utf8_split_characters(k2_tok: Tokenizer) -> None:
    """A character whose bytes span tokens never yields U+FFFD mid-stream, in any channel."""
    ids = build(
        k2_tok,
        Bytes("é中"),
        "</think>",
        Bytes("😀 ok"),
        SB,
        CB,
        "functions.f:0",
        AB,
        Bytes('{"s": "ß🎉"}'),
        CE,
        SE,
    )
    parser = KimiK2Parser(k2_tok, thinking=True, tools=True)
    streamed = run(parser, one_by_one(ids))
    for delta in streamed.deltas:
        assert "\ufffd" not in delta.reasoning + delta.content + "".join(t.arguments for t in delta.tool_calls)
    assert parser.message == ParsedMessage(
        reasoning="é中", content="😀 ok", tool_calls=(tc("functions.f:0", "f", '{"s": "ß🎉"}'),)
    )


def test_utf8_partial_character_before_a_marker(k2_tok: Tokenizer) -> None:
    """Dangling bytes cut off by a marker token decode to U+FFFD, like a full decode would."""
    ids = build(k2_tok, Bytes("é"))[:1] + build(k2_tok, "</think>ok")
    assert parse(KimiK2Parser, k2_tok, ids, thinking=True, tools=True) == ParsedMessage(
        reasoning="\ufffd", content="ok"
    )


FIXTURES = {
    "reasoning-calls-after": (
        True,
        (
            "Plan: check the weather.</think>Sure. ",
            section(call("functions.get_weather:0", '{"city": "Paris"}'), call(" get_news:1 ", ' {"q": "é中"} ')),
            " Done.<|im_end|>",
        ),
    ),
    "thinking-text-marker": (True, ("step by step</thinking>Final answer, café 😀.[EOS]",)),
    "singular-section-text": (
        False,
        (
            "Let me see <|tool_call_section_begin|>",
            call("functions.f:0", '{"a": [1, 2]}'),
            "<|tool_call_section_end|> then more",
        ),
    ),
    "malformed-and-truncated": (
        True,
        (
            "r</think>c ",
            SB,
            call("functions.bad.0", "{}"),
            CB,
            "functions.h",
            call("functions.ok:2", '{"b": true}'),
            CB,
            "functions.cut:3",
            AB,
            '{"x": "trunc',
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_two_push_split_matches_one_shot(k2_tok: Tokenizer, name: str) -> None:
    """For every cut of the ids into two pushes, the deltas join to the one-shot message; no marker text leaks."""
    thinking, parts = FIXTURES[name]
    ids = build(k2_tok, *parts)
    chunkings = [*two_cut_chunkings(ids), one_by_one(ids)]
    assert_chunking_invariant(
        KimiK2Parser, k2_tok, ids, chunkings, forbidden=MARKER_TEXT, thinking=thinking, tools=True
    )


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("tools", [True, False])
def test_random_chunkings_match_one_shot(k2_tok: Tokenizer, name: str, tools: bool) -> None:
    """Many random chunkings (fixed seed) stream exactly the one-shot message."""
    thinking, parts = FIXTURES[name]
    ids = build(k2_tok, *parts)
    rng = random.Random(f"k2-{name}-{tools}")
    assert_chunking_invariant(
        KimiK2Parser,
        k2_tok,
        ids,
        random_chunkings(ids, rng, FUZZ_CHUNKINGS),
        forbidden=MARKER_TEXT,
        thinking=thinking,
        tools=tools,
    )


def test_fixture_messages(k2_tok: Tokenizer) -> None:
    """The chunking fixtures parse to the intended messages (so the invariance tests check something real)."""
    msgs = {name: parse_k2(k2_tok, *parts, thinking=thinking) for name, (thinking, parts) in FIXTURES.items()}
    assert msgs["reasoning-calls-after"] == ParsedMessage(
        reasoning="Plan: check the weather.",
        content="Sure.  Done.",
        tool_calls=(
            tc("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
            tc("get_news:1", "get_news", '{"q": "é中"}'),
        ),
    )
    assert msgs["thinking-text-marker"] == ParsedMessage(reasoning="step by step", content="Final answer, café 😀.")
    assert msgs["singular-section-text"] == ParsedMessage(
        reasoning=None, content="Let me see  then more", tool_calls=(tc("functions.f:0", "f", '{"a": [1, 2]}'),)
    )
    assert msgs["malformed-and-truncated"] == ParsedMessage(
        reasoning="r",
        content="c functions.bad.0{}functions.h",
        tool_calls=(tc("functions.ok:2", "ok", '{"b": true}'), tc("functions.cut:3", "cut", '{"x": "trunc')),
    )


def test_random_token_soup_never_raises(k2_tok: Tokenizer) -> None:
    """Random ids (markers, specials, text, out-of-vocab) never raise and still stream the one-shot message."""
    rng = random.Random(7)
    specials = list(k2_tok.special_tokens.values())
    for _ in range(150):
        ids = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(k2_tok.vocab_size + 5) for _ in range(40)]
        for thinking in (False, True):
            assert_chunking_invariant(
                KimiK2Parser, k2_tok, ids, random_chunkings(ids, rng, 3), thinking=thinking, tools=True
            )


def test_tiktoken_format_tokenizer(k2_tiktoken_tok: Tokenizer) -> None:
    """The same parse through Kimi's tiktoken.model tokenizer format."""
    tok = k2_tiktoken_tok
    ids = build(tok, "think</think>Hi ", section(call("functions.f:0", '{"a": "é"}')), "<|im_end|>")
    msg = assert_chunking_invariant(
        KimiK2Parser, tok, ids, [one_by_one(ids)], forbidden=MARKER_TEXT, thinking=True, tools=True
    )
    assert msg == ParsedMessage(reasoning="think", content="Hi ", tool_calls=(tc("functions.f:0", "f", '{"a": "é"}'),))


def test_text_markers_when_tokenizer_lacks_them(k3_tok: Tokenizer) -> None:
    """With a tokenizer that has no K2 marker tokens (here the K3 one), the K2 markers are matched as text."""
    text = "plan</think>Hi <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    ids = build(k3_tok, Plain(text + '{"a": 1}<|tool_call_end|><|tool_calls_section_end|> bye'))
    chunkings = [*two_cut_chunkings(ids), one_by_one(ids)]
    msg = assert_chunking_invariant(KimiK2Parser, k3_tok, ids, chunkings, thinking=True, tools=True)
    assert msg == ParsedMessage(reasoning="plan", content="Hi  bye", tool_calls=(tc("functions.f:0", "f", '{"a": 1}'),))


def test_push_after_finish_raises_and_finish_is_idempotent(k2_tok: Tokenizer) -> None:
    """finish() twice is harmless; push() after finish() is a caller bug."""
    parser = KimiK2Parser(k2_tok, thinking=False, tools=True)
    streamed = run(parser, [build(k2_tok, "hi")])
    assert_deltas_match_message(streamed, parser.message)
    assert parser.finish() == ParsedDelta()
    with pytest.raises(RuntimeError):
        parser.push([1])
