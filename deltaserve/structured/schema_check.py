"""`check_satisfiable`: refuse a JSON schema that no finite JSON value satisfies, before any generation starts.

A schema can compile and still describe no finite value: `{"type": "object", "properties": {"a": {"$ref": "#"}},
"required": ["a"]}` demands an object inside an object inside ... forever. The grammar libraries accept it and let
generation start; the request then fails (or loops until `max_tokens`) after seconds of decoding. This is the
productivity test of a context-free grammar applied to the schema: a schema is productive if some finite value
satisfies its structure, where a `$ref` being expanded on the current path counts as unproductive (a smallest
finite value never needs to expand the same `$ref` inside itself). It looks only at what makes a value necessary
(`required` properties, `minItems`, `prefixItems`, `allOf`, `anyOf` / `oneOf`, `type`, boolean schemas, local
`$ref`s): anything else is taken as satisfiable, so a schema is refused only when it certainly has no value.

The walk is bounded (`MAX_STEPS` schema nodes): a schema too large to check in that budget is left to the grammar
library, which then behaves as before.
"""

from __future__ import annotations

import json
from typing import Any

MAX_STEPS = 20_000
"""Schema nodes visited at most per check (a few milliseconds); beyond it the schema is assumed satisfiable."""

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class _Budget(Exception):
    """The step budget ran out: no verdict."""


def check_satisfiable(schema_text: str) -> None:
    """ValueError if the JSON schema `schema_text` (a JSON document) admits no finite value."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return  # the backend's own validation reports it
    checker = _Checker(schema)
    try:
        productive = checker.productive(schema, frozenset())
    except _Budget:
        return
    if not productive:
        raise ValueError("the JSON schema admits no finite value (a required property, item or reference always "
                         "leads back to itself, or every alternative is impossible)")


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.steps = 0

    def productive(self, schema: Any, expanding: frozenset[str]) -> bool:
        """Some finite value satisfies `schema`, with the `$ref`s in `expanding` counted as unproductive."""
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Budget
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            return True  # not a schema: the backend decides
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in expanding:
                return False
            target = self._resolve(ref)
            if target is None:
                return True  # a remote or unknown reference: no verdict
            if not self.productive(target, expanding | {ref}):
                return False
        for sub in schema.get("allOf") or ():
            if not self.productive(sub, expanding):
                return False
        for key in ("anyOf", "oneOf"):
            alternatives = schema.get(key)
            if isinstance(alternatives, list) and alternatives and not any(
                    self.productive(sub, expanding) for sub in alternatives):
                return False
        if "enum" in schema or "const" in schema:
            return True  # listed values are finite
        return any(self._type_productive(t, schema, expanding) for t in self._types(schema))

    def _types(self, schema: dict[str, Any]) -> tuple[str, ...]:
        declared = schema.get("type")
        if isinstance(declared, str):
            return (declared,)
        if isinstance(declared, list):
            return tuple(t for t in declared if isinstance(t, str))
        return _TYPES

    def _type_productive(self, kind: str, schema: dict[str, Any], expanding: frozenset[str]) -> bool:
        if kind == "object":
            properties: dict[str, Any] = _get(schema, "properties", dict, {})
            extra = schema.get("additionalProperties", True)
            required: list[Any] = _get(schema, "required", list, [])
            # A name no `properties` entry lists may still match a patternProperties key: no verdict then.
            patterns = bool(schema.get("patternProperties"))
            return all(self.productive(properties[name] if name in properties else True if patterns else extra,
                                       expanding)
                       for name in required if isinstance(name, str))
        if kind == "array":
            prefix: list[Any] = _get(schema, "prefixItems", list, [])
            items = schema.get("items", True)
            if isinstance(items, list):  # draft 4-7 tuple form
                prefix, items = items, schema.get("additionalItems", True)
            needed: int = _get(schema, "minItems", int, 0)
            return (all(self.productive(sub, expanding) for sub in prefix[:needed])
                    and (needed <= len(prefix) or self.productive(items, expanding)))
        return True  # strings, numbers, booleans and null always have a value of their type

    def _resolve(self, ref: str) -> Any:
        """The target of a local reference ("#", "#/$defs/name", ...); None for any other."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


def _get(schema: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """`schema[key]` when it is a `kind`, else `default` (a malformed keyword is the backend's to report)."""
    value = schema.get(key, default)
    return value if isinstance(value, kind) else default
