"""Upstream Kimi K3 parser cases (vLLM, vllm-cubic) re-expressed as conformance checks for `KimiK3Parser`.

Upstream parsers read detokenised text; here each upstream text chunk becomes one push of ids (`<|open|>`,
`<|close|>`, `<|sep|>` as their special-token ids). Where deltaserve decides differently the test says so.
"""

from __future__ import annotations

import pytest

from deltaserve.parsers.kimi_k3 import KimiK3Parser
from deltaserve.text.tokenizer import Tokenizer
from tests.parsers.helpers import Streamed, assert_deltas_match_message, build, run

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN = f"{OPEN}response{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"


def stream(tok: Tokenizer, pieces: list[str], *, thinking: bool, tools: bool = True) -> Streamed:
    """Each upstream text chunk becomes one push; checks the deltas add up to the final message and hold no marker."""
    parser = KimiK3Parser(tok, thinking=thinking, tools=tools)
    streamed = run(parser, [build(tok, p) for p in pieces])
    assert_deltas_match_message(streamed, parser.message)
    for text in (streamed.reasoning, streamed.content):
        assert "<|" not in text and "|>" not in text
    return streamed


def char_pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# --- vLLM tests/reasoning/test_kimi_k3_reasoning_parser.py ---------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "thinking", "reasoning", "content"),
    [
        (f"{THINK_OPEN}step{THINK_CLOSE}{RESPONSE_OPEN}answer", True, "step", "answer"),
        (f"step{THINK_CLOSE}{RESPONSE_OPEN}answer", True, "step", "answer"),
        ("unfinished reasoning", True, "unfinished reasoning", ""),
        ("answer", False, "", "answer"),
        (f"{RESPONSE_OPEN}answer", False, "", "answer"),
    ],
    ids=["xtml_tags", "generation_prefix_consumed", "truncated_before_close", "thinking_disabled", "response_wrapper"],
)
def test_vllm_extract_reasoning(k3_tok: Tokenizer, output: str, thinking: bool, reasoning: str, content: str) -> None:
    """vLLM test_extract_reasoning_* / test_extract_markerless_output_with_thinking_disabled /
    test_delegating_parser_strips_response_wrapper_without_tool_parser / test_thinking_disabled_streams_content."""
    streamed = stream(k3_tok, [output], thinking=thinking)
    assert (streamed.reasoning, streamed.content) == (reasoning, content)


def test_vllm_streaming_split_open_marker_is_held_back(k3_tok: Tokenizer) -> None:
    """vLLM test_streaming_split_open_marker_is_held_back: `<|open|>` / `think` / `<|sep|>step` in three pushes."""
    parser = KimiK3Parser(k3_tok, thinking=True, tools=True)
    deltas = [parser.push(build(k3_tok, p)) for p in (OPEN, "think", f"{SEP}step")]
    assert [d.reasoning for d in deltas] == ["", "", "step"]
    assert not any(d.content for d in deltas)


def test_vllm_streaming_split_close_marker_hands_content_over(k3_tok: Tokenizer) -> None:
    """vLLM test_streaming_split_close_marker_hands_content_downstream: the content after the split close marker
    is the response text alone (upstream hands the wrapper on to the tool parser; here it is unwrapped)."""
    parser = KimiK3Parser(k3_tok, thinking=True, tools=True)
    deltas = [parser.push(build(k3_tok, p)) for p in (f"{THINK_OPEN}step", CLOSE, f"think{SEP}{RESPONSE_OPEN}answer")]
    assert [(d.reasoning, d.content) for d in deltas] == [("step", ""), ("", ""), ("", "answer")]


def test_vllm_delegating_parser_thinking_false(k3_tok: Tokenizer) -> None:
    """vLLM test_delegating_parser_thinking_false_streams_response_content: `OK`, then a split response close."""
    parser = KimiK3Parser(k3_tok, thinking=False, tools=True)
    deltas = [parser.push(build(k3_tok, p)) for p in ("OK", CLOSE, f"response{SEP}")]
    assert [d.content for d in deltas] == ["OK", "", ""]
    assert not parser.finish()


# --- vLLM tests/tool_parsers/test_kimi_k3_tool_parser.py -------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 7, 100])
def test_vllm_content_stops_at_message_close(k3_tok: Tokenizer, size: int) -> None:
    """vLLM test_streaming_content_stops_at_message_close / _holds_split_message_close: text chunked every `size`
    characters (markers stay whole tokens here, so a chunk boundary inside one falls between its tokens)."""
    output = f"Hello{MESSAGE_CLOSE}"
    pieces = char_pieces("Hello", size) + [CLOSE, "message", SEP]
    for chunks in ([output], pieces):
        streamed = stream(k3_tok, chunks, thinking=False)
        assert streamed.content == "Hello" and streamed.calls == []


# --- QuantTrio/vllm-cubic tests/tool_parsers/test_kimi_k3_tool_parser.py ---------------------------------------------


def test_cubic_late_think_close_boundary(k3_tok: Tokenizer) -> None:
    """test_streaming_response_drops_late_think_close_boundary / _holds_partial_think_close_boundary."""
    streamed = stream(k3_tok, [".", CLOSE, "thi", f"nk{SEP}{RESPONSE_OPEN}天地玄黄"], thinking=True)
    assert (streamed.reasoning, streamed.content) == (".", "天地玄黄")


def test_cubic_plain_response_across_split_close_marker(k3_tok: Tokenizer) -> None:
    """test_auto_tool_parser_preserves_plain_response_across_split_close_marker (tools on and off)."""
    pieces = [f"分析最后一句。{THINK_CLOSE}{RESPONSE_OPEN}天地玄黄，宇宙洪荒。", f"{CLOSE}response{SEP}{MESSAGE_CLOSE}"]
    for tools in (True, False):
        streamed = stream(k3_tok, pieces, thinking=True, tools=tools)
        assert (streamed.reasoning, streamed.content) == ("分析最后一句。", "天地玄黄，宇宙洪荒。")


def test_cubic_composed_tool_call(k3_tok: Tokenizer) -> None:
    """test_composed_auto_tool_parser_still_extracts_tool_call: exact arguments text."""
    output = (
        f"分析。{THINK_CLOSE}{RESPONSE_OPEN}先查。{CLOSE}response{SEP}"
        f'{OPEN}tools{SEP}{OPEN}call tool="search" index="1"{SEP}'
        f'{OPEN}argument key="q" type="string"{SEP}天气'
        f"{CLOSE}argument{SEP}{CLOSE}call{SEP}"
        f"{CLOSE}tools{SEP}{MESSAGE_CLOSE}"
    )
    streamed = stream(k3_tok, [output], thinking=True)
    assert (streamed.reasoning, streamed.content) == ("分析。", "先查。")
    assert [(c.name, c.arguments) for c in streamed.tool_calls()] == [("search", '{"q": "天气"}')]


# --- vLLM kimi_k3_tool_parser.py module docstring example -------------------------------------------------------------


def test_vllm_docstring_example(k3_tok: Tokenizer) -> None:
    """The nested tools channel of vllm/tool_parsers/kimi_k3_tool_parser.py's docstring (string + object args)."""
    output = (
        f'{OPEN}tools{SEP}{OPEN}call tool="python" index="1"{SEP}'
        f'{OPEN}argument key="code" type="string"{SEP}print(1){CLOSE}argument{SEP}'
        f'{OPEN}argument key="opts" type="object"{SEP}{{"a":1}}{CLOSE}argument{SEP}'
        f"{CLOSE}call{SEP}{CLOSE}tools{SEP}"
    )
    streamed = stream(k3_tok, [output], thinking=False)
    assert [(c.id, c.name, c.arguments) for c in streamed.tool_calls()] == [
        ("functions.python:0", "python", '{"code": "print(1)", "opts": {"a": 1}}')
    ]
