"""Run grammars for real: llguidance matchers over token ids, a seeded random walk, and call parsers on ids."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import llguidance
import numpy as np

from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer


def matcher(ll: llguidance.LLTokenizer, structured: StructuredOutput) -> llguidance.LLMatcher:
    assert structured.kind == "lark"
    m = llguidance.LLMatcher(ll, structured.spec, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(ll: llguidance.LLTokenizer, structured: StructuredOutput, ids: Sequence[int]) -> bool:
    """The whole id sequence is consumed and leaves the grammar complete."""
    m = matcher(ll, structured)
    return m.consume_tokens(list(ids)) and m.is_accepting() and not m.is_error()


def allowed(m: llguidance.LLMatcher, vocab: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def random_walk(
    m: llguidance.LLMatcher, vocab: int, seed: int, *, specials: frozenset[int], max_tokens: int = 300
) -> list[int]:
    """Sample uniformly among allowed ids until the grammar stops; when a special token is allowed, take one with
    probability 1/2 (so free text such as reasoning ends within the cap)."""
    rng = random.Random(seed)
    out: list[int] = []
    while not m.is_stopped() and len(out) < max_tokens:
        ids = allowed(m, vocab)
        assert len(ids), m.get_error()
        marks = [int(i) for i in ids if int(i) in specials]
        token = rng.choice(marks) if marks and rng.random() < 0.5 else int(rng.choice(list(ids)))
        assert m.consume_token(token), m.get_error()
        out.append(token)
    return out


def pieces(tok: Tokenizer, ids: Sequence[int]) -> list[str | int]:
    """ids as a list of special-token ids and decoded text runs (text never contains a special token)."""
    specials = set(tok.special_tokens.values())
    out: list[str | int] = []
    run: list[int] = []
    for i in [*ids, -1]:
        if i in specials or i == -1:
            if run:
                out.append(tok.decode(run))
                run = []
            if i != -1:
                out.append(i)
        else:
            run.append(i)
    return out


def parse_k2_calls(tok: Tokenizer, ids: Sequence[int], *, thinking: bool) -> list[tuple[str, int, dict]]:
    """[(name, index, arguments)] of a K2 tool-call turn; AssertionError if it is not one."""
    sp = tok.special_tokens
    items = pieces(tok, ids)
    if thinking:
        end = items.index(sp["</think>"])
        assert all(isinstance(p, str) for p in items[:end])
        items = items[end + 1 :]
    assert items[0] == sp["<|tool_calls_section_begin|>"] and items[-2:] == [
        sp["<|tool_calls_section_end|>"],
        sp["<|im_end|>"],
    ]
    body, calls = items[1:-2], []
    while body:
        begin, head, arg, args, end, *body = body
        assert (begin, arg, end) == (
            sp["<|tool_call_begin|>"],
            sp["<|tool_call_argument_begin|>"],
            sp["<|tool_call_end|>"],
        )
        assert head.startswith("functions.")
        name, index = head.removeprefix("functions.").rsplit(":", 1)
        calls.append((name, int(index), json.loads(args)))
    return calls


def _unescape(text: str) -> str:
    return text.replace("&quot;", '"').replace("&amp;", "&")


def parse_k3_calls(tok: Tokenizer, ids: Sequence[int], *, thinking: bool) -> list[tuple[str, int, dict]]:
    """[(name, index, arguments)] of a K3 tool-call turn (after the prompt's open channel); AssertionError if not."""
    sp = tok.special_tokens
    op, cl, sep, eom = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"]
    items = pieces(tok, ids)
    if thinking:
        end = items.index(cl)
        assert all(isinstance(p, str) for p in items[:end])
        assert items[end : end + 6] == [cl, "think", sep, op, "response", sep]
        items = items[end + 6 :]
    assert items[:6] == [cl, "response", sep, op, "tools", sep]
    assert items[-7:] == [cl, "tools", sep, cl, "message", sep, eom]
    body, calls = items[6:-7], []
    while body:
        assert body[0] == op and body[2] == sep and body[1].startswith("call tool=")
        attrs = body[1].removeprefix('call tool="').removesuffix('"').split('" index="')
        body, args = body[3:], {}
        while body[0] == op:
            assert body[1].startswith("argument key=") and body[2] == sep
            key, kind = body[1].removeprefix('argument key="').removesuffix('"').split('" type="')
            value, body = ("", body[3:]) if body[3] == cl else (body[3], body[4:])
            assert body[:3] == [cl, "argument", sep]
            body = body[3:]
            args[_unescape(key)] = value if kind == "string" else json.loads(value)
            assert (
                kind == "string"
                or kind
                == {
                    bool: "boolean",
                    int: "number",
                    float: "number",
                    str: "string",
                    type(None): "null",
                    dict: "object",
                    list: "array",
                }[type(args[_unescape(key)])]
            )
        assert body[:3] == [cl, "call", sep]
        body = body[3:]
        calls.append((_unescape(attrs[0]), int(attrs[1]), args))
    return calls
