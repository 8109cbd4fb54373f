"""Build argparse options from a frozen dataclass; help text comes from the fields' attribute docstrings."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after a field) of a dataclass, by field name."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    if not isinstance(node, ast.ClassDef):  # getsource of a class is its class statement (decorators included)
        raise TypeError(f"{cls!r} is not a class defined in Python source")
    body = node.body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                       aliases: dict[str, str] | None = None) -> None:
    """One `--field-name` option per field of `cls` (bools become --flag / --no-flag, tuples take several values),
    defaults from the class, on a parser or one of its argument groups. Fields holding a nested config dataclass
    get no option: add that class's own options (`dataclass_from_args` builds it from them); nor do fields whose
    metadata says `{"cli": False}` (set by the program, not by a user)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + (aliases or {}).get(f.name, f.name.replace("_", "-"))
        kind = _base_type(hints[f.name])
        if dataclasses.is_dataclass(kind) or not f.metadata.get("cli", True):
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=f.name, nargs="*", type=typing.get_args(kind)[0], default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_parser_for(kind), default=default, help=help_text)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """`cls` from the options `add_dataclass_args` added (lists back to tuples, nested configs built likewise)."""
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        if not f.metadata.get("cli", True):
            continue  # set by the program, not a flag: its default
        if dataclasses.is_dataclass(kind):
            values[f.name] = dataclass_from_args(typing.cast(type, kind), args)
        else:
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def _base_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parser_for(kind: type):
    if kind is int:
        def parse_int(text: str) -> int | None:
            return None if text.lower() in ("none", "null") else int(text)
        return parse_int
    return kind


def check_at_least_one(args: Any, *names: str) -> None:
    """ValueError naming the flag (`--num-prompts`) of the first field among `names` that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def dashes_in_flags(argv: list[str]) -> list[str]:
    """`--num_prompts` read as `--num-prompts`, as vLLM's parser does: underscores in option names become dashes.
    Only tokens shaped like an option (`--name` or `--name=value`, no spaces in the name) change; values such as a
    prompt "--snake_case is here", and anything after `--`, are kept."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, sep, value = arg.partition("=")
        if _OPTION_NAME.fullmatch(name):
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


_OPTION_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")
