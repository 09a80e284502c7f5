"""Manifest validation against the format's JSON Schema, without a jsonschema dependency.

The schema (``manifest.schema.json``, identical to ``formats/musa-stream.schema.json``;
a test pins that) uses a small subset of draft 2020-12, which :func:`validate`
implements: type, const, enum, required, properties, additionalProperties,
propertyNames, items, minItems, maxItems, minimum, minLength, pattern, oneOf and local
``$ref``. Errors name the key path (``ranks[3].units[0].sha256``).
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


def validate(doc, schema: dict | None = None) -> list[str]:
    """Every violation as 'path: message' (empty when valid)."""
    root = schema or manifest_schema()
    errors: list[str] = []
    _check(doc, root, root, "manifest", errors)
    return errors


def _check(v, s: dict, root: dict, path: str, errs: list[str]) -> None:
    if "$ref" in s:
        ref = s["$ref"]
        node = root
        for key in ref.removeprefix("#/").split("/"):
            node = node[key]
        _check(v, node, root, path, errs)
    if "oneOf" in s:
        ok = [sub for sub in s["oneOf"] if not _sub_errors(v, sub, root, path)]
        if len(ok) != 1:
            errs.append(f"{path}: matches {len(ok)} of the allowed forms (need exactly one)")
            return
    if "const" in s and v != s["const"]:
        errs.append(f"{path}: must be {s['const']!r}, got {v!r}")
    if "enum" in s and v not in s["enum"]:
        errs.append(f"{path}: must be one of {s['enum']}, got {v!r}")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_TYPES[t](v) for t in types):
            errs.append(f"{path}: must be {' or '.join(types)}, got {type(v).__name__}")
            return
    if isinstance(v, dict):
        for k in s.get("required", ()):
            if k not in v:
                errs.append(f"{path}: missing required key '{k}'")
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        pn = s.get("propertyNames")
        for k, x in v.items():
            if pn and "pattern" in pn and not _rx(pn["pattern"]).search(k):
                errs.append(f"{path}: key '{k}' does not match {pn['pattern']}")
            if k in props:
                _check(x, props[k], root, f"{path}.{k}", errs)
            elif extra is False:
                errs.append(f"{path}: unknown key '{k}'")
            elif isinstance(extra, dict):
                _check(x, extra, root, f"{path}.{k}", errs)
    if isinstance(v, list):
        if "minItems" in s and len(v) < s["minItems"]:
            errs.append(f"{path}: needs at least {s['minItems']} items")
        if "maxItems" in s and len(v) > s["maxItems"]:
            errs.append(f"{path}: allows at most {s['maxItems']} items")
        if "items" in s:
            for i, x in enumerate(v):
                _check(x, s["items"], root, f"{path}[{i}]", errs)
    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"]:
            errs.append(f"{path}: must not be empty")
        if "pattern" in s and not _rx(s["pattern"]).search(v):
            errs.append(f"{path}: {v!r} does not match {s['pattern']}")
    if (
        "minimum" in s
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v < s["minimum"]
    ):
        errs.append(f"{path}: must be >= {s['minimum']}, got {v}")


def _sub_errors(v, s, root, path) -> list[str]:
    errs: list[str] = []
    _check(v, s, root, path, errs)
    return errs
