"""`check_satisfiable`: JSON schemas that admit no finite value are refused; every schema with one passes."""

from __future__ import annotations

import json

import pytest

from deltaserve.structured.schema_check import check_satisfiable

UNSATISFIABLE = {
    "required-self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "bare-self": {"$ref": "#"},
    "array-self": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "mutual": {"$defs": {"x": {"type": "object", "properties": {"b": {"$ref": "#/$defs/y"}}, "required": ["b"]},
                         "y": {"type": "array", "prefixItems": [{"$ref": "#/$defs/x"}], "minItems": 1}},
               "$ref": "#/$defs/x"},
    "required-but-forbidden": {"type": "object", "required": ["a"], "additionalProperties": False},
    "false-property": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    "false": False,
    "no-alternative": {"anyOf": [{"$ref": "#"}, False]},
    "all-of-one-impossible": {"allOf": [{"type": "string"}, {"$ref": "#"}]},
}
SATISFIABLE = {
    "optional-self": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "empty-array-self": {"type": "array", "items": {"$ref": "#"}},
    "nullable-link": {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"},
    "untyped": {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # a string satisfies it
    "pattern-property": {"type": "object", "patternProperties": {"^a$": {}}, "required": ["a"],
                         "additionalProperties": False},
    "alternative": {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    "remote-ref": {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}, "required": ["a"]},
    "enum": {"enum": [1, 2]},
    "true": True,
    "weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"]},
}


@pytest.mark.parametrize("name", UNSATISFIABLE)
def test_unsatisfiable_schemas_are_refused(name):
    with pytest.raises(ValueError, match="no finite value"):
        check_satisfiable(json.dumps(UNSATISFIABLE[name]))


@pytest.mark.parametrize("name", SATISFIABLE)
def test_satisfiable_schemas_pass(name):
    check_satisfiable(json.dumps(SATISFIABLE[name]))


def test_the_walk_is_bounded():
    """A schema whose walk would be exponential (each level refers to the next twice) ends within the step budget,
    without a verdict."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                        "b": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a", "b"]}
            for i in range(60)}
    defs["d60"] = {"type": "string"}
    check_satisfiable(json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))  # unbounded, this would visit 2^60 nodes
