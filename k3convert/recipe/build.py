"""Typed building of the recipe's dataclasses from parsed YAML: unknown keys (with the
nearest valid one), wrong types and missing keys are errors naming the key path."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from ..errors import SHORT, ConfigError, short_repr

#: dataclass fields that are not recipe keys
SKIP = {"origin"}


def key_text(key: Any) -> str:
    """A mapping key for a key path: short, one line."""
    k = key if isinstance(key, str) else short_repr(key)
    k = k.replace("\n", "\\n")
    return k if len(k) <= SHORT else k[: SHORT - 3] + "..."


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def convert(value: Any, tp, path: str, src: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(value, inner[0], path, src)
    if is_dataclass(tp):
        return build(tp, value, path, src)
    if origin is tuple:
        elem = args[0]
        if isinstance(value, (str, int, float, bool)) or value is None:
            value = [] if value is None else [value]
        if not isinstance(value, list):
            raise ConfigError(f"{src}: '{path}' must be a list, got {short_repr(value)}.")
        return tuple(convert(v, elem, f"{path}[{i}]", src) for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: '{path}' must be a mapping, got {short_repr(value)}.")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{src}: '{path}' must be true or false, got {short_repr(value)}.")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{src}: '{path}' must be a string, got {short_repr(value)}.")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{src}: '{path}' must be a number, got {short_repr(value)}.")
        return float(value)
    if tp is int:
        # bools are ints to Python, not to a recipe: group_size: true is a mistake
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{src}: '{path}' must be an integer, got {short_repr(value)}.")
        return value
    return value


def build(cls, data: Any, path: str, src: str):
    where = path or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: '{where}' must be a mapping, got {short_repr(data)}.")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls) if f.name not in SKIP]
    kwargs = {}
    for key, value in data.items():
        kp = f"{path}.{key_text(key)}" if path else key_text(key)
        if key not in valid:
            close = difflib.get_close_matches(key_text(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else "."
            raise ConfigError(
                f"{src}: unknown key '{kp}'{hint} Valid keys at '{where}': {', '.join(valid)}."
            )
        kwargs[key] = convert(value, hints[key], kp, src)
    for f in fields(cls):
        if f.name in SKIP or f.name in kwargs:
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            kp = f"{path}.{f.name}" if path else f.name
            raise ConfigError(f"{src}: missing required key '{kp}'.")
    return cls(**kwargs)
