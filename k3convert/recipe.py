"""Recipe files: YAML parsed with ``yaml.safe_load`` into frozen dataclasses.

A recipe says what a conversion does, so it is validated completely before anything
runs: unknown keys are an error naming the key path (``quantize.rules[1].sheme``) and
the nearest valid key, values are type-checked, scheme names and their options are
resolved against the registry, and patterns are compiled. Example::

    description: Kimi-K2 with int4 routed experts
    quantize:
      rules:
        - roles: [experts]
          scheme: w4a16
          options: {group_size: 32}
        - roles: [attention]
          scheme: fp8-block
      keep: ["re:.*layers\\.0\\..*"]   # optional extra keeps
      default_keep: true                # architecture default exceptions

Tensors matched by no rule are kept unless ``quantize.scheme`` names a default.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError


@dataclass(frozen=True)
class RuleSpec:
    """One quantization rule: tensors matching ``match`` AND ``roles`` get ``scheme``.

    match: glob(s) or ``re:`` regex(es) on tensor / module names (empty: any);
    roles: component / alias / kind names (empty: any); scheme: registered name or
    ``keep``; options: scheme overrides (group_size, symmetric, block, scale_fmt,
    scale_dtype, num_bits, strategy).
    """

    scheme: str
    match: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizeSection:
    scheme: str | None = None
    rules: tuple[RuleSpec, ...] = ()
    keep: tuple[str, ...] = ()
    default_keep: bool = True


@dataclass(frozen=True)
class Recipe:
    description: str = ""
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    source: str = field(default="<recipe>", compare=False)


_SKIP = {"source"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _convert(value: Any, tp, path: str, src: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path, src)
    if is_dataclass(tp):
        return _build(tp, value, path, src)
    if origin is tuple:
        elem = args[0]
        if isinstance(value, (str, int, float, bool)) or value is None:
            value = [] if value is None else [value]
        if not isinstance(value, list):
            raise ConfigError(f"{src}: '{path}' must be a list, got {type(value).__name__}.")
        return tuple(_convert(v, elem, f"{path}[{i}]", src) for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: '{path}' must be a mapping, got {type(value).__name__}.")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{src}: '{path}' must be true or false, got {value!r}.")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{src}: '{path}' must be a string, got {value!r}.")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{src}: '{path}' must be an integer, got {value!r}.")
        return value
    return value


def _build(cls, data: Any, path: str, src: str):
    where = path or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: '{where}' must be a mapping, got {type(data).__name__}.")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls) if f.name not in _SKIP]
    kwargs = {}
    for key, value in data.items():
        kp = f"{path}.{key}" if path else str(key)
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{src}: unknown key '{kp}'{hint} Valid keys at '{where}': {', '.join(valid)}."
            )
        kwargs[key] = _convert(value, hints[key], kp, src)
    for f in fields(cls):
        if f.name in _SKIP or f.name in kwargs:
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            kp = f"{path}.{f.name}" if path else f.name
            raise ConfigError(f"{src}: missing required key '{kp}'.")
    return cls(**kwargs)


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    """A validated Recipe from a parsed YAML document (dict)."""
    r = _build(Recipe, data, "", source)
    r = Recipe(r.description, r.quantize, source)
    _validate(r)
    return r


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe YAML file (``yaml.safe_load``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read recipe ({e.strerror}).") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem}); fix the recipe file.") from e
    return parse_recipe(data, str(p))


def _validate(r: Recipe) -> None:
    from .quant.rules import KEEP, check_pattern
    from .quant.schemes import get_scheme

    q = r.quantize
    if q.scheme is not None:
        _scheme(get_scheme, q.scheme, {}, f"{r.source}: quantize.scheme")
    for i, rule in enumerate(q.rules):
        where = f"{r.source}: quantize.rules[{i}]"
        if rule.scheme != KEEP:
            _scheme(get_scheme, rule.scheme, rule.options, where)
        elif rule.options:
            raise ConfigError(f"{where}: a 'keep' rule takes no options.")
        for p in rule.match:
            check_pattern(p, f"{where}.match")
    for i, p in enumerate(q.keep):
        check_pattern(p, f"{r.source}: quantize.keep[{i}]")
    if not q.rules and q.scheme is None:
        raise ConfigError(
            f"{r.source}: quantize needs 'rules' or a default 'scheme'; as written it "
            f"would keep every tensor."
        )


def _scheme(get_scheme, name: str, options: dict, where: str) -> None:
    try:
        get_scheme(name, **options)
    except ConfigError as e:
        raise type(e)(f"{where}: {e}") from e
    except TypeError as e:  # option of the wrong type
        raise ConfigError(f"{where}: bad options {options!r} ({e}).") from e
