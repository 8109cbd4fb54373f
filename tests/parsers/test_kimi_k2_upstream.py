"""Upstream Kimi K2 parser cases (vLLM, SGLang) re-expressed as conformance checks for `KimiK2Parser`.

Upstream parsers read detokenised text; here each upstream text chunk becomes one push of ids (markers as their
special-token ids). Where deltaserve decides differently the test says so and pins deltaserve's behaviour.
"""

from __future__ import annotations

import json

import pytest

from deltaserve.parsers.kimi_k2 import KimiK2Parser
from deltaserve.text.tokenizer import Tokenizer
from tests.parsers.helpers import Streamed, assert_deltas_match_message, build, run

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
ALL_MARKERS = (SB, SE, CB, AB, CE, "<think>", "</think>")


def _tool(tool_id: str, args: str) -> str:
    """vLLM's helper: note the space after the id."""
    return f"{CB}{tool_id} {AB}{args}{CE}"


def _wrap(*tools: str) -> str:
    return SB + "".join(tools) + SE


def stream(tok: Tokenizer, pieces: list[str], *, thinking: bool = False, tools: bool = True) -> Streamed:
    """Each upstream text chunk becomes one push; checks the deltas add up to the final message."""
    parser = KimiK2Parser(tok, thinking=thinking, tools=tools)
    streamed = run(parser, [build(tok, p) for p in pieces])
    assert_deltas_match_message(streamed, parser.message)
    for marker in ALL_MARKERS:
        assert marker not in streamed.content and marker not in streamed.reasoning
    return streamed


# --- vLLM tests/tool_parsers/test_kimi_k2_tool_parser.py -------------------------------------------------------------

EXTRACT_CASES = {
    "single_tool_call": (
        "I'll check. " + _wrap(_tool("functions.get_weather:0", '{"city": "Beijing"}')),
        ["get_weather"],
        [{"city": "Beijing"}],
        "I'll check. ",
    ),
    "parallel_tool_calls": (
        "Compare weather. "
        + _wrap(
            _tool("functions.get_weather:0", '{"city": "Beijing"}'),
            _tool("functions.get_weather:1", '{"city": "Shanghai"}'),
        ),
        ["get_weather", "get_weather"],
        [{"city": "Beijing"}, {"city": "Shanghai"}],
        "Compare weather. ",
    ),
    "three_tool_calls": (
        "Multiple tasks. "
        + _wrap(
            _tool("functions.get_weather:0", '{"city": "New York"}'),
            _tool("functions.get_news:1", '{"topic": "technology"}'),
            _tool("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}'),
        ),
        ["get_weather", "get_news", "send_email"],
        [{"city": "New York"}, {"topic": "technology"}, {"to": "user@example.com", "subject": "Daily Update"}],
        "Multiple tasks. ",
    ),
    "angle_brackets_in_json": (
        "Process HTML. " + _wrap(_tool("functions.process_html:0", '{"html": "<div>content</div>"}')),
        ["process_html"],
        [{"html": "<div>content</div>"}],
        "Process HTML. ",
    ),
    "multiline_json": (
        "Formatted. " + _wrap(_tool("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')),
        ["process_data"],
        [{"name": "test", "value": 123}],
        "Formatted. ",
    ),
    "no_functions_prefix": (
        "No prefix. " + _wrap(_tool("get_weather:0", '{"city": "Tokyo"}')),
        ["get_weather"],
        [{"city": "Tokyo"}],
        "No prefix. ",
    ),
    "empty_arguments": ("Empty args. " + _wrap(_tool("functions.test:0", "{}")), ["test"], [{}], "Empty args. "),
}


@pytest.mark.parametrize("case", sorted(EXTRACT_CASES))
@pytest.mark.parametrize("streaming", [False, True], ids=["one-shot", "token-by-token"])
def test_vllm_extract_tool_calls(k2_tok: Tokenizer, case: str, streaming: bool) -> None:
    """vLLM TestExtractToolCalls.test_extract_tool_calls (+ test_streaming_matches_nonstreaming)."""
    output, names, args, content = EXTRACT_CASES[case]
    ids = build(k2_tok, output)
    chunks = [[i] for i in ids] if streaming else [ids]
    streamed = run(KimiK2Parser(k2_tok, thinking=False, tools=True), chunks)
    assert streamed.content == content
    calls = streamed.tool_calls()
    assert [c.name for c in calls] == names
    assert [json.loads(c.arguments) for c in calls] == args
    assert all(c.id.split(":")[-1].isdigit() for c in calls)


def test_vllm_no_tools(k2_tok: Tokenizer) -> None:
    """vLLM test_no_tools / test_no_tool_calls."""
    streamed = stream(k2_tok, ["This is just ", "regular text ", "without tools."])
    assert streamed.content == "This is just regular text without tools." and streamed.calls == []


def test_vllm_invalid_json_still_extracted(k2_tok: Tokenizer) -> None:
    """vLLM test_invalid_json_still_extracted: a call with invalid JSON is returned with its raw arguments."""
    out = "Help. " + SB + _tool("functions.bad:0", '{"city": "Beijing"') + _tool("functions.good:1", '{"c": "S"}') + SE
    calls = stream(k2_tok, [out]).tool_calls()
    assert [c.name for c in calls] == ["bad", "good"]
    assert calls[0].arguments == '{"city": "Beijing"'


def test_vllm_invalid_funcall_id_skipped(k2_tok: Tokenizer) -> None:
    """vLLM test_invalid_funcall_id_skipped. deltaserve: the skipped call's text goes to content (the contract)."""
    out = "Help. " + SB + _tool("functions.invalid.0", '{"city": "Beijing"}') + _tool("functions.valid:1", "{}") + SE
    streamed = stream(k2_tok, [out])
    assert [c.name for c in streamed.tool_calls()] == ["valid"]
    assert streamed.content == 'Help. functions.invalid.0 {"city": "Beijing"}'


def test_vllm_native_id_and_multi_turn_continuity(k2_tok: Tokenizer) -> None:
    """vLLM test_native_id_extracted / test_multi_turn_native_id_continuity: the id is the model's header."""
    first = stream(k2_tok, ["Checking weather. " + _wrap(_tool("functions.get_weather:0", '{"city": "Tokyo"}'))])
    second = stream(k2_tok, ["Now news. " + _wrap(_tool("functions.get_news:0", '{"topic": "x"}'))])
    assert first.tool_calls()[0].id == "functions.get_weather:0"
    assert second.tool_calls()[0].id == "functions.get_news:0"


def test_vllm_streaming_split_deltas(k2_tok: Tokenizer) -> None:
    """vLLM TestStreamingHappyPath (single, multiple, incremental arguments, content before tools)."""
    pieces = ["I'll check the weather. ", SB, CB, "functions.get_weather:0 ", AB, '{"ci', 'ty": "Be', 'ijing"}', " "]
    pieces += [CE, CB, "functions.get_weather:1 ", AB, '{"city": "NYC"} ', CE, SE]
    streamed = stream(k2_tok, pieces)
    assert streamed.content == "I'll check the weather. "
    assert [(c.id, c.name, json.loads(c.arguments)) for c in streamed.tool_calls()] == [
        ("functions.get_weather:0", "get_weather", {"city": "Beijing"}),
        ("functions.get_weather:1", "get_weather", {"city": "NYC"}),
    ]
    assert "get_weather" not in streamed.content and "Beijing" not in streamed.content


def test_vllm_noise_and_empty_section(k2_tok: Tokenizer) -> None:
    """vLLM test_noise_between_markers_suppressed / test_empty_tool_section."""
    noisy = stream(k2_tok, ["Reasoning. ", SB, " spurious noise ", CB, "functions.test:0 ", AB, '{"k": "v"} ', CE, SE])
    assert noisy.content == "Reasoning. " and [c.name for c in noisy.tool_calls()] == ["test"]
    empty = stream(k2_tok, ["Reasoning. ", SB, SE])
    assert empty.calls == [] and empty.content == "Reasoning. "


def test_vllm_three_different_tools_unique_ids(k2_tok: Tokenizer) -> None:
    """vLLM test_three_different_tools."""
    out = _wrap(
        _tool("functions.get_weather:0", "{}"), _tool("functions.get_news:1", "{}"), _tool("functions.e:2", "{}")
    )
    calls = stream(k2_tok, ["Multiple tasks. ", out]).tool_calls()
    assert [c.name for c in calls] == ["get_weather", "get_news", "e"] and len({c.id for c in calls}) == 3


def test_vllm_truncated_tool_call_no_end_marker(k2_tok: Tokenizer) -> None:
    """vLLM test_truncated_tool_call_no_end_marker: the partial call is kept with its partial arguments."""
    streamed = stream(k2_tok, ["I'll check. ", SB, CB, "functions.get_weather:0 ", AB, '{"city": "Bei'])
    assert streamed.tool_calls()[0].arguments == '{"city": "Bei'
    assert streamed.tool_calls()[0].id == "functions.get_weather:0"
    assert streamed.content == "I'll check. "


def test_vllm_content_after_tool_section(k2_tok: Tokenizer) -> None:
    """vLLM test_content_after_tool_section. deltaserve differs on purpose: text after the section is content."""
    pieces = ["Before. ", SB, CB, "functions.get_weather:0 ", AB, '{"city": "Tokyo"} ', CE, SE, " After tools."]
    streamed = stream(k2_tok, pieces)
    assert json.loads(streamed.tool_calls()[0].arguments) == {"city": "Tokyo"}
    assert streamed.content == "Before.  After tools."


@pytest.mark.parametrize("interval", [1, 2, 3, 5, 8, 9999])
def test_vllm_streaming_intervals(k2_tok: Tokenizer, interval: int) -> None:
    """vLLM TestStreamingIntervals: ids grouped `interval` at a time."""
    text = "Sure, let me check. " + _wrap(
        _tool("functions.search:0", '{"q": "cats"}'), _tool("functions.search:1", "{}")
    )
    ids = build(k2_tok, text)
    streamed = run(
        KimiK2Parser(k2_tok, thinking=False, tools=True), [ids[i : i + interval] for i in range(0, len(ids), interval)]
    )
    assert streamed.content == "Sure, let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in streamed.tool_calls()] == [
        ("search", {"q": "cats"}),
        ("search", {}),
    ]


# --- vLLM tests/reasoning/test_kimi_k2_reasoning_parser.py ---------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "reasoning", "content"),
    [
        ("<think>step by step reasoning</think>final answer", "step by step reasoning", "final answer"),
        ("<think></think>final answer", "", "final answer"),
        ("implicit reasoning with no tags", "implicit reasoning with no tags", ""),
        ("some reasoning" + SB + "tool call data", "some reasoning", ""),
    ],
    ids=["think_tags", "empty_thinking", "implicit_start", "tool_section_ends_reasoning"],
)
def test_vllm_reasoning_extract(k2_tok: Tokenizer, output: str, reasoning: str, content: str) -> None:
    """vLLM test_extract_reasoning_*: upstream keeps the section text as content for the tool parser; here the
    stray section text is noise inside a section and is dropped."""
    streamed = stream(k2_tok, [output], thinking=True)
    assert (streamed.reasoning, streamed.content) == (reasoning, content)


def test_vllm_streaming_reasoning_then_content(k2_tok: Tokenizer) -> None:
    """vLLM test_streaming_reasoning_then_content: token by token, markers produce no delta text."""
    parser = KimiK2Parser(k2_tok, thinking=True, tools=True)
    deltas = [parser.push(build(k2_tok, p)) for p in ("<think>", "step one", "</think>", "answer")]
    assert [(d.reasoning, d.content) for d in deltas] == [("", ""), ("step one", ""), ("", ""), ("", "answer")]


def test_vllm_thinking_disabled_is_identity(k2_tok: Tokenizer) -> None:
    """vLLM test_parser_selection_thinking_disabled: thinking off, everything is content."""
    streamed = stream(k2_tok, ["no reasoning here"], thinking=False)
    assert (streamed.reasoning, streamed.content) == ("", "no reasoning here")


# --- SGLang KimiK2Detector tests --------------------------------------------------------------------------------------
# test/srt/test_function_call_parser.py (TestKimiK2Detector), test/registered/function_call/test_kimik2_detector.py,
# and sgl-project/sglang-jax test/srt/function_call/test_kimik2_detector.py.


def test_sglang_single_and_multiple_exact_parameters(k2_tok: Tokenizer) -> None:
    """SGLang test_single_tool_call / test_multiple_tool_calls: exact arguments text, no normal text."""
    one = SB + CB + "functions.get_weather:0" + AB + '{"city": "Paris"}' + CE + SE
    two = SB + CB + "functions.get_weather:0" + AB + '{"city": "Paris"}' + CE
    two += CB + "functions.get_tourist_attractions:1" + AB + '{"city": "London"}' + CE + SE
    assert [(c.name, c.arguments) for c in stream(k2_tok, [one]).tool_calls()] == [("get_weather", '{"city": "Paris"}')]
    streamed = stream(k2_tok, [two])
    assert streamed.content == ""
    assert [(c.name, c.arguments) for c in streamed.tool_calls()] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_tourist_attractions", '{"city": "London"}'),
    ]


def test_sglang_streaming_chunks(k2_tok: Tokenizer) -> None:
    """SGLang test_streaming_tool_call / test_streaming_multiple_tool_calls / test_tool_name_streaming."""
    head = SB + CB + "functions.get_weather:0" + AB + "{"
    pieces = [head, '"city": "Paris"', "}" + CE, CB + "functions.get_tourist_attractions:1" + AB + "{"]
    pieces += ['"city": "London"', "}" + CE, SE]
    calls = stream(k2_tok, pieces).tool_calls()
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_tourist_attractions", '{"city": "London"}'),
    ]


def test_sglang_partial_tool_call(k2_tok: Tokenizer) -> None:
    """SGLang test_partial_tool_call: a truncated call keeps its partial arguments."""
    calls = stream(k2_tok, [SB + CB + "functions.get_weather:0" + AB + "{", '"city": "Paris"']).tool_calls()
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"')]


def test_sglang_invalid_tool_call_without_section(k2_tok: Tokenizer) -> None:
    """SGLang test_invalid_tool_call: no call begin, so no call. deltaserve drops the marker tokens from content."""
    streamed = stream(k2_tok, ['invalid_tool:0<|tool_call_argument_begin|>{"city": "Paris"}' + CE + SE])
    assert streamed.calls == [] and streamed.content == 'invalid_tool:0{"city": "Paris"}'


def test_sglang_nested_braces_not_truncated(k2_tok: Tokenizer) -> None:
    """SGLang test_detect_and_parse_nested_braces_not_truncated."""
    args = {"path": "x.md", "content": "# T\n```py\nd={'k': 1}\n```\ndone } { more"}
    calls = stream(k2_tok, [_wrap(CB + "functions.write_to_file:0" + AB + json.dumps(args) + CE)]).tool_calls()
    assert json.loads(calls[0].arguments) == args


def test_sglang_local_index_hyphenated_and_unparsable_ids(k2_tok: Tokenizer) -> None:
    """SGLang: `:N` is a conversation counter (indices stay 0-based); hyphenated MCP names; `weird@id` skipped."""
    out = SB + CB + "functions.read_file:5" + AB + "{}" + CE + CB + "weird@id" + AB + '{"city": "London"}' + CE
    out += CB + "mcp__portal__search-docs:6" + AB + '{"q": "x"}' + CE + SE
    streamed = stream(k2_tok, [out])
    assert [(c.id, c.name) for c in streamed.tool_calls()] == [
        ("functions.read_file:5", "read_file"),
        ("mcp__portal__search-docs:6", "mcp__portal__search-docs"),
    ]
    assert streamed.content == 'weird@id{"city": "London"}'  # deltaserve: the skipped call degrades to content


def test_sglang_trailing_left_angle_not_dropped(k2_tok: Tokenizer) -> None:
    """SGLang test_trailing_left_angle_is_not_dropped: a trailing `<` (a possible text-marker start) is held, then
    flushed by finish(), never dropped."""
    assert stream(k2_tok, ["a < b <"]).content == "a < b <"


def test_sglang_orphan_tool_call_begin(k2_tok: Tokenizer) -> None:
    """SGLang test_orphan_tool_call_begin_is_discarded: no call from the orphan header (deltaserve: to content)."""
    pieces = [SB + CB + "functions.read_file:0", CB + "functions.get_weather:1" + AB + '{"city": "Oslo"}' + CE + SE]
    streamed = stream(k2_tok, pieces)
    assert [(c.name, c.arguments) for c in streamed.tool_calls()] == [("get_weather", '{"city": "Oslo"}')]
    assert streamed.content == "functions.read_file:0"


def test_sglang_whitespace_inside_section_and_arguments(k2_tok: Tokenizer) -> None:
    """SGLang test_whitespace_inside_section_is_not_content / test_argument_whitespace_is_stripped.
    deltaserve keeps the newline after the section end as content (text after the section is content)."""
    pieces = ["Checking.", "\n", SB, "\n", CB + "functions.read_file:0" + AB + '{"path": "/a"}' + CE, "\n"]
    pieces += [CB + "functions.get_weather:1" + AB, " ", '{"city": ', '"A"} ', "\n", CE, "\n", SE, "\n"]
    streamed = stream(k2_tok, pieces)
    assert streamed.content == "Checking.\n\n"
    assert [(c.name, c.arguments) for c in streamed.tool_calls()] == [
        ("read_file", '{"path": "/a"}'),
        ("get_weather", '{"city": "A"}'),
    ]


def test_sglang_tool_call_inside_think_without_close(k2_tok: Tokenizer) -> None:
    """SGLang test_tool_call_inside_think_without_close_tag (streaming and one-shot): the section ends reasoning."""
    pieces = ["<think>", "I need to", " read the file.", SB, CB + "functions.ReadFile:5", AB]
    pieces += ['{"path": "/Users/user/project/file.ts"}', CE, SE]
    streamed = stream(k2_tok, pieces, thinking=True)
    assert streamed.reasoning == "I need to read the file."
    assert [(c.id, c.name) for c in streamed.tool_calls()] == [("functions.ReadFile:5", "ReadFile")]


def test_sglang_content_between_think_and_sections(k2_tok: Tokenizer) -> None:
    """SGLang e2e: content between </think> and the markers survives; two back-to-back sections give two calls."""
    pieces = ["<think>", "Thinking about it...", "</think>This is a ", "content:" + SB + CB + "functions.get_weather:0"]
    pieces += [
        AB + '{"city": "London"}' + CE + SE + SB + CB + "functions.get_weather:1" + AB + '{"city": "Delhi"}' + CE + SE
    ]
    streamed = stream(k2_tok, pieces, thinking=True)
    assert (streamed.reasoning, streamed.content) == ("Thinking about it...", "This is a content:")
    assert [c.arguments for c in streamed.tool_calls()] == ['{"city": "London"}', '{"city": "Delhi"}']


def test_sglang_special_tokens_never_leak(k2_tok: Tokenizer) -> None:
    """SGLang TestKimiK2DetectorSpecialTokenLeakage: stray end / argument markers are stripped from content."""
    assert stream(k2_tok, ["normal text" + SE]).content == "normal text"
    assert stream(k2_tok, ["text" + AB + "more"]).content == "textmore"
