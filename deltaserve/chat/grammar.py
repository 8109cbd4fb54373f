"""Pieces of llguidance Lark grammars shared by the chat formats: literals, special tokens, embedded JSON schemas.

Special tokens are written by id (`<[163586]>`), which works for any tokenizer llguidance is given, whether or not
it knows the token's name; each gets a lowercase rule named after it so the grammars stay readable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import regex_to_lark

from deltaserve.sampling_params import StructuredOutput

REASONING_TERMINAL = "REASONING: /(?s:.*)/"  # any text; a special token (the end-of-reasoning marker) ends it
MAX_PARALLEL_CALLS = 16  # calls one tool-call grammar admits with parallel=True (indices are spelled out)
JSON_TYPES: tuple[str, ...] = ("string", "number", "integer", "boolean", "null", "object", "array")
_SCHEMA_DEFS = ("$defs", "definitions")


def lark_str(text: str) -> str:
    """`text` as a Lark string literal (JSON string syntax, which llguidance's Lark accepts)."""
    return json.dumps(text, ensure_ascii=False)


def token_rule(rule: str, token_id: int) -> str:
    """A rule matching exactly the special token `token_id`."""
    return f"{rule}: <[{token_id}]>"


def compact(schema: Any) -> Any:
    """`schema` with llguidance's fixed-whitespace JSON options (Python's `json.dumps` separators, no other
    whitespace, so a weak model cannot loop on it), unless the schema sets its own "x-guidance" options."""
    if isinstance(schema, Mapping) and "x-guidance" not in schema:
        return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                         "key_separator": ": "}}
    return schema


def json_rule(rule: str, schema: Mapping[str, Any]) -> str:
    """A rule matching one compact JSON value valid for `schema` (llguidance's embedded `%json`)."""
    return f"{rule}: %json {json.dumps(compact(schema), ensure_ascii=False, separators=(',', ':'))}"


def answer_rule(rule: str, structured: StructuredOutput) -> str:
    """A rule matching exactly the text `structured` constrains (json_schema, json_object, regex or lark)."""
    if structured.kind == "json_schema":
        try:
            schema = json.loads(structured.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured json_schema spec is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured json_schema spec must be a JSON object")
        return f"{rule}: %json {json.dumps(compact(schema), ensure_ascii=False)}"
    if structured.kind == "json_object":
        return json_rule(rule, {"type": "object"})
    if structured.kind == "regex":
        return f"{rule}: /{regex_to_lark(structured.spec, '')}/"
    # A nested grammar keeps the client's rule names (including its own `start`) apart from ours.
    return f"{rule}: %lark {{\n{structured.spec}\n}}"


def with_defs(schema: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` (a property of `root`) with `root`'s `$defs` / `definitions` copied in, so its `$ref`s resolve."""
    out = dict(schema)
    for key in _SCHEMA_DEFS:
        if key in root and key not in out:
            out[key] = root[key]
    return out


def schema_types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a value of `schema` may have, in `JSON_TYPES` order (all of them when unconstrained)."""
    declared = schema.get("type")
    if isinstance(declared, str):
        types = {declared}
    elif isinstance(declared, list):
        types = {t for t in declared if isinstance(t, str)}
    elif "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema.get("enum") or ())
        types = {json_type(v) for v in values}
    else:
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            types = {t for b in branches if isinstance(b, Mapping) for t in schema_types(b)}
        else:
            types = set(JSON_TYPES) - {"integer"}
    if "number" in types:
        types.discard("integer")
    return [t for t in JSON_TYPES if t in types]


def json_type(value: Any) -> str:
    """JSON type name of a Python value from `json.loads`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def _branches(schema: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    branches = schema.get("anyOf") or schema.get("oneOf")
    if "type" in schema or not isinstance(branches, list):
        return None
    return [b for b in branches if isinstance(b, Mapping)]


def narrowed(schema: Mapping[str, Any], json_t: str) -> dict[str, Any]:
    """`schema` restricted to values of one JSON type (enum / const filtered, anyOf branches of other types dropped)."""
    branches = _branches(schema)
    if branches is not None:
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return {**rest, "anyOf": [narrowed(b, json_t) for b in branches if json_t in schema_types(b)]}
    out = dict(schema)
    out["type"] = json_t
    fits = {json_t, "integer"} if json_t == "number" else {json_t}
    if "enum" in out:
        out["enum"] = [v for v in out["enum"] if json_type(v) in fits]
    return out


def raw_string_body(schema: Mapping[str, Any]) -> str:
    """Terminal body for an unquoted string value obeying `schema` (enum, const, min/maxLength, pattern, anyOf)."""
    branches = _branches(schema)
    if branches is not None:
        return " | ".join(raw_string_body(b) for b in branches if "string" in schema_types(b))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        strings = [v for v in values if isinstance(v, str)]
        if not strings:
            raise ValueError(f"schema {dict(schema)!r} allows no string value")
        return " | ".join(lark_str(s) for s in strings)
    parts = []
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        parts.append(f"/(?s:.){{{int(lo or 0)},{'' if hi is None else int(hi)}}}/")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        # JSON schema patterns search unanchored, with ECMAScript's ASCII \d \w \s; lexer regexes match whole.
        body = regex_to_lark(pattern, "dws")
        starts, ends = body.startswith("^"), body.endswith("$") and not body.endswith("\\$")
        core = body[int(starts) : len(body) - int(ends)]
        parts.append(f"/{'' if starts else '(?s:.*)'}(?:{core}){'' if ends else '(?s:.*)'}/")
    return " & ".join(parts) if parts else "/(?s:.*)/"
