"""llguidance grammars for Kimi K3 output: forced tool calls and constrained answers inside the XTML channels.

The assistant turn the model completes (the prompt opened `think` in thinking mode, `response` otherwise):
    [reasoning <|close|>think<|sep|><|open|>response<|sep|>] answer <|close|>response<|sep|>
    [<|open|>tools<|sep|> calls <|close|>tools<|sep|>] <|close|>message<|sep|><|end_of_msg|>
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deltaserve.chat.format import pick_tools
from deltaserve.chat.grammar import (
    MAX_PARALLEL_CALLS,
    REASONING_TERMINAL,
    answer_rule,
    json_rule,
    lark_str,
    narrowed,
    raw_string_body,
    schema_types,
    token_rule,
    with_defs,
)
from deltaserve.chat.messages import ToolSpec
from deltaserve.chat.xtml import CLOSE, END_OF_MSG, OPEN, SEP, escape_attr
from deltaserve.sampling_params import StructuredOutput

_TOKENS = {"open": OPEN, "close": CLOSE, "sep": SEP, "eom": END_OF_MSG}
_THINK = 'REASONING close "think" sep open "response" sep '  # finish the think channel, open the response
_END = 'close "message" sep eom'


def _shared(special_ids: Mapping[str, int], thinking: bool) -> list[str]:
    rules = [token_rule(rule, special_ids[token]) for rule, token in _TOKENS.items()]
    return [*rules, REASONING_TERMINAL] if thinking else rules


def tool_call_grammar(
    special_ids: Mapping[str, int], tools: Sequence[ToolSpec], *, name: str | None, parallel: bool, thinking: bool
) -> StructuredOutput:
    """Empty response channel, then a tools block of one (parallel: up to `MAX_PARALLEL_CALLS`) call(s)."""
    chosen = pick_tools(tools, name)
    n = MAX_PARALLEL_CALLS if parallel else 1
    calls = "call_1 more_2?" if n > 1 else "call_1"
    head = _THINK if thinking else ""
    lines = [
        "%llguidance {}",
        f'start: {head}close "response" sep open "tools" sep {calls} close "tools" sep {_END}',
    ]
    lines += [f"more_{k}: call_{k}{f' more_{k + 1}?' if k < n else ''}" for k in range(2, n + 1)]
    args: list[str | None] = []
    for j, tool in enumerate(chosen):
        rule, rules = _arguments(j, tool.parameters)
        args.append(rule)
        lines += rules
    for k in range(1, n + 1):
        heads = []
        for j, tool in enumerate(chosen):
            head_text = lark_str(f'call tool="{escape_attr(tool.name)}" index="{k}"')
            heads.append(f"{head_text} sep {args[j]}" if args[j] else f"{head_text} sep")
        lines.append(f'call_{k}: open ({" | ".join(heads)}) close "call" sep')
    return StructuredOutput("lark", "\n".join([*lines, *_shared(special_ids, thinking)]) + "\n")


def _arguments(j: int, parameters: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """(rule name or None when the tool takes no arguments, rules): one argument element per property, in order."""
    properties = parameters.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        return None, []
    required = set(parameters.get("required") or ())
    items, rules = [], []
    for p, (key, sub) in enumerate(properties.items()):
        schema = with_defs(sub, parameters) if isinstance(sub, Mapping) else {}
        branches = []
        for json_t in schema_types(schema):
            attr = lark_str(f'"{"number" if json_t == "integer" else json_t}"')
            if json_t == "string":
                rules.append(f"STR_{j}_{p}: {raw_string_body(narrowed(schema, 'string'))}")
                branches.append(f"{attr} sep STR_{j}_{p}")
            else:
                rules.append(json_rule(f"val_{j}_{p}_{json_t}", narrowed(schema, json_t)))
                branches.append(f"{attr} sep val_{j}_{p}_{json_t}")
        opening = lark_str(f'argument key="{escape_attr(key)}" type=')
        rules.append(f'arg_{j}_{p}: open {opening} ({" | ".join(branches)}) close "argument" sep')
        items.append(f"arg_{j}_{p}" if key in required else f"arg_{j}_{p}?")
    rules.append(f"args_{j}: {' '.join(items)}")
    return f"args_{j}", rules


def answer_grammar(special_ids: Mapping[str, int], structured: StructuredOutput, *, thinking: bool) -> StructuredOutput:
    """[think channel] the answer in the response channel, then end of message."""
    head = _THINK if thinking else ""
    lines = ["%llguidance {}", f'start: {head}answer close "response" sep {_END}', answer_rule("answer", structured)]
    return StructuredOutput("lark", "\n".join([*lines, *_shared(special_ids, thinking)]) + "\n")
