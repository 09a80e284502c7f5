"""Manifest validation against the format's JSON Schema, without a jsonschema dependency.

The schema (``manifest.schema.json``, identical to ``formats/musa-stream.schema.json``;
a test pins that) uses a small subset of draft 2020-12, which :func:`validate`
implements: type, const, enum, required, properties, additionalProperties,
propertyNames, items, minItems, maxItems, minimum, maximum, minLength, pattern, oneOf,
if / then / else and local ``$ref``. Errors name the key path (``ranks[3].units[0].hash``).

Two entry points: the schema itself (``manifest.json``, every version) and its
``$defs/rank_file`` (a version 3 / 4 rank file, ``rankNNNNN/units.json``):
:func:`validate_rank_file`.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@cache
def manifest_schema() -> dict:
    text = resources.files(__package__).joinpath("manifest.schema.json").read_text("utf-8")
    return json.loads(text)


@cache
def _rx(p: str) -> re.Pattern:
    return re.compile(p)


def validate(doc, schema: dict | None = None, *, ranks=None) -> list[str]:
    """Every violation as 'path: message' (empty when valid).

    ``ranks`` (versions 1 and 2, whose units are inline): a set of rank indices whose
    tensor entries are checked; every other unit keeps only its first tensor entry
    checked (the header and every rank and unit field are still checked in full), so
    opening one rank of a wide stream does not check the other ranks' entries -
    :func:`validate_rank_tensors` checks those when a rank is used. A version 3 manifest
    holds no units: each rank file is checked by :func:`validate_rank_file`.
    """
    root = schema or manifest_schema()
    errors: list = []
    _compiled(root)(doc if ranks is None else _shell(doc, ranks), ("manifest",), errors)
    return _render(errors)


def validate_rank_tensors(doc: dict, i: int, schema: dict | None = None) -> list[str]:
    """The tensor entries of rank ``i``'s units (what ``validate(ranks=...)`` left out
    when ``i`` was not among them), with the same error paths."""
    root = schema or manifest_schema()
    check = _compiled_def(root, "tensor")
    errors: list = []
    base = ((("manifest",), "ranks"), i)
    for j, u in enumerate(doc["ranks"][i]["units"]):
        where = (((base, "units"), j), "tensors")
        for k, t in enumerate(u["tensors"]):
            check(t, (where, k), errors)
    return _render(errors)


def validate_rank_file(rdoc, i: int, schema: dict | None = None) -> list[str]:
    """Every violation of rank ``i``'s rank file ``rdoc`` against ``$defs/rank_file``;
    unit paths read as in a version 1 / 2 manifest (``ranks[i].units[0].hash``), the
    file's own keys as ``ranks[i].<key>`` of the rank file."""
    root = schema or manifest_schema()
    errors: list = []
    _compiled_def(root, "rank_file")(rdoc, ((("manifest",), "ranks"), i), errors)
    return _render(errors)


def _shell(doc, ranks) -> object:
    """``doc`` with the units of ranks not in ``ranks`` cut to their first tensor entry
    (shallow copies: ``doc`` is not changed; anything malformed is left as it is, for the
    schema to report)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list):
        return doc
    out = []
    for i, r in enumerate(doc["ranks"]):
        if i in ranks or not isinstance(r, dict) or not isinstance(r.get("units"), list):
            out.append(r)
            continue
        units = [
            {**u, "tensors": u["tensors"][:1]}
            if isinstance(u, dict) and isinstance(u.get("tensors"), list)
            else u
            for u in r["units"]
        ]
        out.append({**r, "units": units})
    return {**doc, "ranks": out}


_COMPILED_DEFS: dict[tuple[int, str], object] = {}


def _compiled_def(root: dict, name: str):
    """The compiled ``$defs/name`` node of ``root`` (cached like :func:`_compiled`)."""
    key = (id(root), name)
    if key not in _COMPILED_DEFS or _COMPILED_DEFS[key][0] is not root:
        _COMPILED_DEFS[key] = (root, _compile(root["$defs"][name], root, {}))
    return _COMPILED_DEFS[key][1]


# The schema is compiled once into nested closures (one per schema node, so a $ref'd
# node shared by a million tensor entries is compiled once), and the key path of a value
# is a chain of (parent, key) tuples rendered only when an error is reported: a manifest
# with hundreds of thousands of tensor entries validates in about a second, not a minute.
_COMPILED: dict[int, object] = {}


def _compiled(root: dict):
    """The compiled form of ``root``, made on first use (schemas are not changed in place
    once in use: the packaged one is read once and cached)."""
    if id(root) not in _COMPILED or _COMPILED[id(root)][0] is not root:
        memo: dict[int, object] = {}
        _COMPILED[id(root)] = (root, _compile(root, root, memo))
    return _COMPILED[id(root)][1]


def _render(errors: list) -> list[str]:
    """(path, message) pairs as 'path: message' (paths are rendered only here: a oneOf
    branch that does not match records errors that are counted, never shown)."""
    return [f"{_where(p)}: {m}" for p, m in errors]


def _where(p: tuple) -> str:
    keys = []
    while len(p) == 2:
        p, k = p
        keys.append(k)
    out = p[0]
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else f".{k}"
    return out


def _compile(s: dict, root: dict, memo: dict):
    """A function ``(value, path, errors) -> False | None`` checking ``value`` against
    schema node ``s`` (False: stop checking this node, as after a type mismatch)."""
    if id(s) in memo:
        return memo[id(s)]
    checks: list = []

    def run(v, p, errs):
        for c in checks:
            if c(v, p, errs) is False:
                return False
        return None

    memo[id(s)] = run  # before the subnodes: a node may refer to itself
    checks.extend(_applicator_checks(s, root, memo))
    checks.extend(_value_checks(s))
    if any(k in s for k in ("required", "properties", "additionalProperties", "propertyNames")):
        checks.append(_object_check(s, root, memo))
    if any(k in s for k in ("minItems", "maxItems", "items")):
        checks.append(_array_check(s, root, memo))
    checks.extend(_scalar_checks(s))
    return run


def _applicator_checks(s: dict, root: dict, memo: dict) -> list:
    """The checks of node ``s`` that apply other nodes: ``$ref``, ``oneOf``, ``if`` /
    ``then`` / ``else``, in that order."""
    checks: list = []
    if "$ref" in s:
        node = root
        for key in s["$ref"].removeprefix("#/").split("/"):
            node = node[key]
        target = _compile(node, root, memo)

        def ref(v, p, errs):
            target(v, p, errs)  # a stop inside the referenced node ends only that node
            return None

        checks.append(ref)
    if "oneOf" in s:
        subs = [_compile(sub, root, memo) for sub in s["oneOf"]]

        def one_of(v, p, errs):
            ok = 0
            for sub in subs:
                e: list[str] = []
                sub(v, p, e)
                ok += not e
            if ok != 1:
                errs.append((p, f"matches {ok} of the allowed forms (need exactly one)"))
                return False
            return None

        checks.append(one_of)
    if "if" in s:
        cond = _compile(s["if"], root, memo)
        then_f = _compile(s["then"], root, memo) if "then" in s else None
        else_f = _compile(s["else"], root, memo) if "else" in s else None

        def if_then_else(v, p, errs):
            e: list[str] = []
            cond(v, p, e)
            branch = else_f if e else then_f
            if branch is not None:
                branch(v, p, errs)  # a stop inside a branch ends only that branch
            return None

        checks.append(if_then_else)
    return checks


def _value_checks(s: dict) -> list:
    """The checks of node ``s`` on the value itself: ``const``, ``enum``, ``type``."""
    checks: list = []
    if "const" in s:
        want = s["const"]

        def const(v, p, errs):
            if v != want:
                errs.append((p, f"must be {want!r}, got {v!r}"))

        checks.append(const)
    if "enum" in s:
        allowed = s["enum"]

        def enum(v, p, errs):
            if v not in allowed:
                errs.append((p, f"must be one of {allowed}, got {v!r}"))

        checks.append(enum)
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        preds = [_TYPES[t] for t in types]

        def typed(v, p, errs):
            for pred in preds:
                if pred(v):
                    return None
            errs.append((p, f"must be {' or '.join(types)}, got {type(v).__name__}"))
            return False

        checks.append(typed)
    return checks


def _object_check(s: dict, root: dict, memo: dict):
    """Node ``s``'s ``required``, ``properties``, ``additionalProperties`` and
    ``propertyNames``, as one check (of objects only)."""
    required = tuple(s.get("required", ()))
    props = {k: _compile(x, root, memo) for k, x in s.get("properties", {}).items()}
    extra = s.get("additionalProperties", True)
    extra_f = _compile(extra, root, memo) if isinstance(extra, dict) else None
    pn = s.get("propertyNames") or {}
    names = _rx(pn["pattern"]) if "pattern" in pn else None

    def obj(v, p, errs):
        if not isinstance(v, dict):
            return None
        for k in required:
            if k not in v:
                errs.append((p, f"missing required key '{k}'"))
        for k, x in v.items():
            if names is not None and not names.search(k):
                errs.append((p, f"key '{k}' does not match {pn['pattern']}"))
            f = props.get(k)
            if f is not None:
                f(x, (p, k), errs)
            elif extra is False:
                errs.append((p, f"unknown key '{k}'"))
            elif extra_f is not None:
                extra_f(x, (p, k), errs)
        return None

    return obj


def _array_check(s: dict, root: dict, memo: dict):
    """Node ``s``'s ``minItems``, ``maxItems`` and ``items``, as one check (of arrays
    only)."""
    lo, hi = s.get("minItems"), s.get("maxItems")
    item = _compile(s["items"], root, memo) if "items" in s else None

    def arr(v, p, errs):
        if not isinstance(v, list):
            return None
        if lo is not None and len(v) < lo:
            errs.append((p, f"needs at least {lo} items"))
        if hi is not None and len(v) > hi:
            errs.append((p, f"allows at most {hi} items"))
        if item is not None:
            for i, x in enumerate(v):
                item(x, (p, i), errs)
        return None

    return arr


def _scalar_checks(s: dict) -> list:
    """The checks of node ``s`` on strings (``minLength``, ``pattern``) and numbers
    (``maximum``, ``minimum``), in that order."""
    checks: list = []
    if "minLength" in s or "pattern" in s:
        min_len = s.get("minLength")
        rx = _rx(s["pattern"]) if "pattern" in s else None

        def string(v, p, errs):
            if not isinstance(v, str):
                return None
            if min_len is not None and len(v) < min_len:
                errs.append((p, "must not be empty"))
            if rx is not None and not rx.search(v):
                errs.append((p, f"{v!r} does not match {s['pattern']}"))
            return None

        checks.append(string)
    if "maximum" in s:
        maximum = s["maximum"]

        def at_most(v, p, errs):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > maximum:
                errs.append((p, f"must be <= {maximum}, got {v}"))

        checks.append(at_most)
    if "minimum" in s:
        minimum = s["minimum"]

        def at_least(v, p, errs):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < minimum:
                errs.append((p, f"must be >= {minimum}, got {v}"))

        checks.append(at_least)
    return checks
