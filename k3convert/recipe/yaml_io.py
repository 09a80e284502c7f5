"""Reading a recipe's YAML defensively (bounded size, depth and alias expansion,
duplicate keys refused) and applying ``--set KEY=VALUE`` overrides to the document."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..calibrate.data import looks_like_path
from ..errors import ConfigError, short_repr
from .build import key_text

#: a recipe is a few KiB; anything larger is not one
MAX_RECIPE_BYTES = 1 << 20
#: YAML nodes a recipe may expand to, every alias counted as a copy of its anchor
MAX_NODES = 100_000
#: nesting levels of sequences / mappings
MAX_DEPTH = 64


def read_recipe_text(p: Path) -> str:
    """A recipe file's text: bounded in size, UTF-8."""
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
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            f"save the recipe as UTF-8."
        ) from e


def apply_overrides(data: Any, overrides: Sequence[str], src: str = "<recipe>") -> Any:
    """``KEY.PATH=VALUE`` overrides (``layout.tp=8``, ``quantize.rules[0].scheme=w4a16``,
    ``verify.enabled=false``) set into a parsed document; VALUE is read as YAML (``8`` is
    an integer, ``[1, 2]`` a list, ``null`` unsets). Validation happens afterwards, so a
    bad key or value fails with its key path like one written in the file."""
    if not overrides:
        return data
    doc = copy.deepcopy(data) if data is not None else {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{src}: 'top level' must be a mapping, got {short_repr(doc)}.")
    for item in overrides:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--set {short_repr(item)}: expected KEY=VALUE, e.g. --set layout.tp=8."
            )
        try:
            value = load_yaml(text, f"--set {key}") if text.strip() else None
        except ConfigError as e:
            raise ConfigError(f"--set {key}: the value is not valid YAML ({e}).") from None
        steps = _key_steps(key)
        if not steps or any(st == "" for st in steps):
            raise ConfigError(f"--set {short_repr(item)}: empty key path; e.g. --set layout.tp=8.")
        value = _cwd_path(_steps_text([st for st in steps if isinstance(st, str)]), value)
        node = doc
        for i, (step, nxt) in enumerate(zip(steps, [*steps[1:], None], strict=True)):
            where = _steps_text(steps[: i + 1])
            last = nxt is None
            if isinstance(step, int):
                if not isinstance(node, list) or not -len(node) <= step < len(node):
                    raise ConfigError(
                        f"--set {key}: '{where}' is not an element of the recipe "
                        f"({'no such index' if isinstance(node, list) else 'not a list'})."
                    )
            elif not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{_steps_text(steps[:i])}' is not a mapping.")
            if last:
                node[step] = value
            else:
                if isinstance(step, str) and node.get(step) is None:
                    node[step] = {} if isinstance(nxt, str) else []
                node = node[step]
    return doc


#: recipe keys whose value is a path (a ``--set`` value is taken from the working
#: directory, as anything typed on a command line; the file's own values from its folder)
PATH_KEYS = {
    "source.path", "layout.expert_load", "verify.data", "verify.reference",
    "verify.pixel_values", "quantize.calibrate.dataset", "quantize.calibrate.offload_dir",
    "quantize.auto_keep.plot",
}  # fmt: skip
_PATH_WORDS = {"layout.expert_load": "calibration", "verify.reference": "transformers"}


def _cwd_path(key: str, value: Any) -> Any:
    if key not in PATH_KEYS or not isinstance(value, str) or value == _PATH_WORDS.get(key):
        return value
    if key == "quantize.calibrate.dataset" and not (looks_like_path(value) or Path(value).exists()):
        return value  # a dataset name
    return str(Path(value).expanduser().absolute())


def _key_steps(key: str) -> list:
    steps: list = []
    for part in key.split("."):
        name, *idx = part.split("[")
        if name:
            steps.append(name)
        for i in idx:
            try:
                steps.append(int(i.rstrip("]")))
            except ValueError:
                raise ConfigError(f"--set {key}: bad index [{i}; write e.g. rules[0].") from None
    return steps


def _steps_text(steps: list) -> str:
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else (f".{s}" if out else s)
    return out


def load_yaml(text: str, src: str) -> Any:
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
                        f"{self._at(event.start_mark)}: alias *{key_text(event.anchor)} "
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
                f"{self._src}:{line}: duplicate key '{key_text(key)}' (first at line "
                f"{first}); YAML would silently keep the last one - remove one."
            )
        return node
