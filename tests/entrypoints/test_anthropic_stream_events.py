"""The Anthropic event stream built from parser updates (no server): tool calls whose arguments do not parse become
text, as in the non-streamed message, and `stop_reason` counts only the calls that parsed."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from deltaserve.engine.output_processor import SequenceUpdate
from deltaserve.entrypoints.anthropic.messages import _events
from deltaserve.parsers.types import ParsedDelta, ToolCallDelta


def _updates(*calls: tuple[str, str, list[str]]) -> list[SequenceUpdate]:
    """One update with text, then each call's id and name and its argument pieces, then the end (reason 'stop')."""
    updates = [SequenceUpdate(index=0, delta=ParsedDelta(content="Checking."), token_ids=[1], logprobs=[None])]
    for i, (call_id, name, pieces) in enumerate(calls):
        head = ParsedDelta(tool_calls=(ToolCallDelta(index=i, id=call_id, name=name),))
        updates.append(SequenceUpdate(index=0, delta=head, token_ids=[2], logprobs=[None]))
        updates += [SequenceUpdate(index=0, delta=ParsedDelta(tool_calls=(ToolCallDelta(index=i, arguments=p),)),
                                   token_ids=[3], logprobs=[None]) for p in pieces]
    updates.append(SequenceUpdate(index=0, delta=ParsedDelta(), token_ids=[], logprobs=[], finish_reason="stop"))
    return updates


def _run(updates: list[SequenceUpdate]) -> list[dict]:
    async def stream():
        for u in updates:
            yield u

    async def collect():
        plan = SimpleNamespace(prompt_ids=[1, 2, 3], thinking=False)
        frontend = SimpleNamespace(model_name="m")
        return [json.loads(e.split("data: ", 1)[1]) async for e in _events(frontend, plan, "msg_1", stream())]

    return asyncio.run(collect())


def test_tool_call_with_broken_arguments_streams_as_text():
    events = _run(_updates(("functions.add:0", "add", ['{"a": 2, ', '"b": 3}']),
                           ("functions.get_weather:1", "get_weather", ['{"city": "Bone_unit": "meters"}'])))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "text", "tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[1] == {"type": "text_delta", "text": '{"city": "Bone_unit": "meters"}'}
    assert json.loads(deltas[2]["partial_json"]) == {"a": 2, "b": 3} and starts[2]["name"] == "add"
    indexes = [e["index"] for e in events if e["type"] in ("content_block_start", "content_block_stop")]
    assert indexes == [0, 0, 1, 1, 2, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"


def test_only_broken_calls_end_the_turn():
    events = _run(_updates(("functions.f:0", "f", ['{"x": ']),))
    assert not any(e.get("content_block", {}).get("type") == "tool_use" for e in events)
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
