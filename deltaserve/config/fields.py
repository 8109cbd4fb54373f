"""Typed, validated access to the fields of a checkpoint's config dict, and type checks of config dataclasses: every
error names the field it is about."""

from __future__ import annotations

import json
import math
import numbers
import os
import types
import typing
from dataclasses import fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class ConfigError(ValueError):
    """A checkpoint config field is missing, unsupported or inconsistent; the message names the field."""


_MISSING = object()


class ConfigFields:
    """Typed access to a config dict; every error names the field (with aliases) it is about."""

    def __init__(self, raw: dict[str, Any], prefix: str = "") -> None:
        self.raw, self.prefix = raw, prefix

    def _get(self, names: tuple[str, ...], default: Any) -> tuple[str, Any]:
        for name in names:
            if name in self.raw:
                return name, self.raw[name]
        if default is _MISSING:
            alias = f" (or {', '.join(self.prefix + n for n in names[1:])})" if len(names) > 1 else ""
            raise ConfigError(f"config field {self.prefix}{names[0]}{alias} is missing")
        return names[0], default

    def as_int(self, *names: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        name, value = self._get(names, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"config field {self.prefix}{name}={value!r} must be an integer >= {minimum}")
        return value

    def as_float(self, *names: str, default: Any = _MISSING) -> Any:
        name, value = self._get(names, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"config field {self.prefix}{name}={value!r} must be a finite number")
        return float(value)

    def as_bool(self, *names: str, default: Any = _MISSING) -> bool:
        name, value = self._get(names, default)
        if not isinstance(value, bool):
            raise ConfigError(f"config field {self.prefix}{name}={value!r} must be true or false")
        return value

    def as_str(self, *names: str, default: Any = _MISSING) -> str:
        name, value = self._get(names, default)
        if not isinstance(value, str):
            raise ConfigError(f"config field {self.prefix}{name}={value!r} must be a string")
        return value

    def get_raw(self, name: str) -> Any:
        return self._get((name,), _MISSING)[1]

    def as_dict(self, name: str) -> dict[str, Any]:
        _, value = self._get((name,), _MISSING)
        if not isinstance(value, dict):
            raise ConfigError(f"config field {self.prefix}{name} must be an object")
        return value


def check_field_types(config: DataclassInstance) -> None:
    """ValueError naming the field whose value is not of its annotated type (``block_size="16"``, ``seed=1.5``),
    instead of a comparison or torch error later. Values of a compatible kind are normalised in place: numpy and
    other integers to int (bool is not an int here), reals to float where a float is expected (an int is one),
    and path-likes to str. Fields typed otherwise (generics, Literal, nested configs) are checked by class only."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        hint, value = hints[f.name], getattr(config, f.name)
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed = tuple(typing.get_origin(t) or t for t in members)
        if not all(isinstance(t, type) for t in allowed):
            continue  # Literal and the like: the config's own checks apply
        normalised = _normalise(value, allowed)
        if normalised is _INVALID:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r:.60}")
        if normalised is not value:
            object.__setattr__(config, f.name, normalised)


_INVALID = object()


def _normalise(value: Any, allowed: tuple[type, ...]) -> Any:
    """`value` as one of the `allowed` types, or _INVALID if it is none of them."""
    if isinstance(value, bool):
        return value if bool in allowed else _INVALID
    if isinstance(value, allowed) and not (isinstance(value, numbers.Number) and type(value) not in allowed):
        return value
    if isinstance(value, numbers.Integral) and int in allowed:
        return int(value)
    if isinstance(value, numbers.Real) and float in allowed:
        return float(value)
    if isinstance(value, os.PathLike) and str in allowed:
        return os.fspath(value)
    return _INVALID


def parse_json_object(value: str | dict[str, Any], name: str) -> dict[str, Any]:
    """A JSON object given as text (a command-line flag) or already decoded; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r:.60}")
    return value


def check_known_fields(value: dict[str, Any], known: list[str], name: str, ignored: frozenset[str] = frozenset()
                       ) -> None:
    """ValueError naming the keys of `value` that are neither `known` nor `ignored`."""
    unknown = sorted(set(value) - set(known) - ignored)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {', '.join(map(repr, unknown))} "
                         f"(supported: {', '.join(known)})")
