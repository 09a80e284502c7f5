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
      calibrate:                        # optional: every --calibrate option
        algorithm: gptq
        dataset: default
        num_samples: 256
        kv_cache: fp8
      auto_keep: {budget: 5%, scheme: int8-g128}   # optional: --auto-keep

A ``calibrate`` / ``auto_keep`` section applies when the command line (or the API call)
gives no ``--calibrate`` / ``--auto-keep`` of its own; one that does replaces the
recipe's section as a whole.

Tensors matched by no rule are kept unless ``quantize.scheme`` names a default.

Reading is defensive (``yaml.safe_load`` semantics through a SafeLoader subclass): a
recipe must be UTF-8 and at most :data:`MAX_RECIPE_BYTES`; nesting deeper than
:data:`MAX_DEPTH` levels and documents that expand (aliases repeating their anchors) to
more than :data:`MAX_NODES` nodes are refused while composing, before anything is
expanded (billion-laughs bombs); duplicate keys are an error naming the key and its
lines. Messages quote a bad value as its type and a short prefix (:func:`short_repr`),
never the whole value.
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

from .calibrate.sequential import SequentialOptions
from .errors import SHORT, ConfigError, short_repr


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
class CalibrateSection(SequentialOptions):
    """``quantize --calibrate``'s options: every field of
    :class:`k3convert.calibrate.sequential.SequentialOptions`, plus the algorithm."""

    algorithm: str = "gptq"

    def options(self) -> SequentialOptions:
        return SequentialOptions(
            **{f.name: getattr(self, f.name) for f in fields(SequentialOptions)}
        )


@dataclass(frozen=True)
class AutoKeepSection:
    """``quantize --auto-keep``: budget, ladder scheme, sensitivity method, chart path."""

    budget: str
    scheme: str | None = None
    sensitivity: str = "layer"
    plot: str | None = None


@dataclass(frozen=True)
class QuantizeSection:
    scheme: str | None = None
    rules: tuple[RuleSpec, ...] = ()
    keep: tuple[str, ...] = ()
    default_keep: bool = True
    calibrate: CalibrateSection | None = None
    auto_keep: AutoKeepSection | None = None


@dataclass(frozen=True)
class Recipe:
    description: str = ""
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    source: str = field(default="<recipe>", compare=False)


_SKIP = {"source"}

#: a recipe is a few KiB; anything larger is not one
MAX_RECIPE_BYTES = 1 << 20
#: YAML nodes a recipe may expand to, every alias counted as a copy of its anchor
MAX_NODES = 100_000
#: nesting levels of sequences / mappings
MAX_DEPTH = 64


def _key_text(key: Any) -> str:
    """A mapping key for a key path: short, one line."""
    k = key if isinstance(key, str) else short_repr(key)
    k = k.replace("\n", "\\n")
    return k if len(k) <= SHORT else k[: SHORT - 3] + "..."


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
            raise ConfigError(f"{src}: '{path}' must be a list, got {short_repr(value)}.")
        return tuple(_convert(v, elem, f"{path}[{i}]", src) for i, v in enumerate(value))
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


def _build(cls, data: Any, path: str, src: str):
    where = path or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: '{where}' must be a mapping, got {short_repr(data)}.")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls) if f.name not in _SKIP]
    kwargs = {}
    for key, value in data.items():
        kp = f"{path}.{_key_text(key)}" if path else _key_text(key)
        if key not in valid:
            close = difflib.get_close_matches(_key_text(key), valid, n=1)
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
    """Read and validate a recipe YAML file (``yaml.safe_load`` semantics, bounded: see
    the module doc)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read recipe ({e.strerror}).") from e
    if len(raw) > MAX_RECIPE_BYTES:
        raise ConfigError(
            f"{p}: larger than {MAX_RECIPE_BYTES >> 10} KiB; a recipe is a short YAML file "
            f"- is this the right path?"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            f"save the recipe as UTF-8."
        ) from e
    return parse_recipe(_load_yaml(text, str(p)), str(p))


def _load_yaml(text: str, src: str) -> Any:
    loader = None
    try:
        loader = _RecipeLoader(text, src)  # checks every character is printable
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{src}:{mark.line + 1}:{mark.column + 1}" if mark else src
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        problem = " ".join(str(problem).split())
        if len(problem) > 120:
            problem = problem[:117] + "..."
        raise ConfigError(f"{where}: not valid YAML ({problem}); fix the recipe file.") from e
    except RecursionError as e:  # MAX_DEPTH stops nesting first; a last resort
        raise ConfigError(f"{src}: nested too deeply to read; a recipe is flat.") from e
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        msg = " ".join(str(e).split())[:120]
        raise ConfigError(f"{src}: a value cannot be read ({msg}); fix the recipe.") from e
    finally:
        if loader is not None:
            loader.dispose()


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses, while composing (before any value is built or expanded):
    nesting deeper than MAX_DEPTH, recursive aliases, documents whose expansion (each
    alias counted as a copy of its anchor's nodes) exceeds MAX_NODES, and duplicate
    mapping keys."""

    def __init__(self, text: str, src: str):
        super().__init__(text)
        self._src = src
        self._depth = 0
        self._total = 0  # expanded nodes composed so far
        self._sizes: dict[int, int] = {}  # id(node) -> its expanded size, once complete

    def _at(self, mark) -> str:
        return f"{self._src}:{mark.line + 1}" if mark is not None else self._src

    def _grow(self, n: int, mark) -> None:
        self._total += n
        if self._total > MAX_NODES:
            raise ConfigError(
                f"{self._at(mark)}: the recipe expands to more than {MAX_NODES} YAML "
                f"nodes (each *alias repeats its &anchor); refusing what looks like an "
                f"alias bomb - a recipe needs a few hundred."
            )

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                size = self._sizes.get(id(node))
                if size is None:
                    raise ConfigError(
                        f"{self._at(event.start_mark)}: alias *{_key_text(event.anchor)} "
                        f"refers to a collection that contains it (recursive alias)."
                    )
                self._grow(size, event.start_mark)
            return super().compose_node(parent, index)
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ConfigError(
                f"{self._at(mark)}: nested more than {MAX_DEPTH} levels deep; a recipe is "
                f"a few levels of mappings and lists."
            )
        start = self._total
        self._grow(1, mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._sizes[id(node)] = self._total - start
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        # duplicate keys, on the keys as written (before merge keys are flattened in)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                if first is None:
                    seen[key] = line
                    continue
            except TypeError:  # unhashable: SafeConstructor reports it
                continue
            raise ConfigError(
                f"{self._src}:{line}: duplicate key '{_key_text(key)}' (first at line "
                f"{first}); YAML would silently keep the last one - remove one."
            )
        return node


def _validate(r: Recipe) -> None:
    from .quant.rules import KEEP, check_pattern
    from .quant.schemes import get_scheme

    q = r.quantize
    if q.scheme is not None:
        _scheme(get_scheme, q.scheme, {}, f"{r.source}: quantize.scheme")
    for i, rule in enumerate(q.rules):
        where = f"{r.source}: quantize.rules[{i}]"
        if rule.scheme != KEEP:
            _check_options(get_scheme, rule, f"quantize.rules[{i}]", r.source)
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
    if q.calibrate is not None:
        from .calibrate.sequential import ALGORITHMS

        where = f"{r.source}: quantize.calibrate"
        if q.calibrate.algorithm not in ALGORITHMS:
            close = difflib.get_close_matches(q.calibrate.algorithm, ALGORITHMS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where}.algorithm: '{_key_text(q.calibrate.algorithm)}' is not known; use "
                f"one of {', '.join(ALGORITHMS)}.{hint}"
            )
        try:
            q.calibrate.options().check()
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if q.auto_keep is not None:
        from .calibrate.sensitivity import METHODS, parse_budget

        where = f"{r.source}: quantize.auto_keep"
        try:
            parse_budget(q.auto_keep.budget)
            if q.auto_keep.scheme is not None:
                get_scheme(q.auto_keep.scheme)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if q.auto_keep.sensitivity not in METHODS:
            raise ConfigError(
                f"{where}.sensitivity: '{_key_text(q.auto_keep.sensitivity)}' is not known; "
                f"use one of {', '.join(METHODS)}."
            )


def _check_options(get_scheme, rule: RuleSpec, path: str, src: str) -> None:
    """Every option is a field of the rule's scheme and has that field's type (key path
    in the message: ``quantize.rules[0].options.group_size must be an integer``)."""
    try:
        scheme = get_scheme(rule.scheme)
    except ConfigError as e:
        raise type(e)(f"{src}: {path}: {e}") from e
    hints = typing.get_type_hints(type(scheme))
    allowed = scheme.options()
    for key, value in rule.options.items():
        kp = f"{path}.options.{_key_text(key)}"
        if not isinstance(key, str) or key not in allowed:
            close = difflib.get_close_matches(_key_text(key), list(allowed), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{src}: unknown key '{kp}': scheme '{rule.scheme}' has no option "
                f"'{_key_text(key)}'.{hint} "
                f"Its options: {', '.join(allowed) or 'none'}."
            )
        _convert(value, hints[key], kp, src)


def _scheme(get_scheme, name: str, options: dict, where: str) -> None:
    try:
        get_scheme(name, **options)
    except ConfigError as e:
        raise type(e)(f"{where}: {e}") from e
    except TypeError as e:  # option of the wrong type
        raise ConfigError(f"{where}: bad options {short_repr(options)} ({e}).") from e
