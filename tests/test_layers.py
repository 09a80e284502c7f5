"""The package's import structure, read from the code's own imports (``ast``).

The packages sit in layers (``LAYERS``, bottom first). A module may import packages of
its own layer and of the layers below; an import that points at a higher layer, or a
cycle between packages (counted with the imports inside functions too: hidden ones are
still cycles), fails. ``docs/architecture.md`` draws the same layers. Sizes: the
functions and modules still over the limits are listed with their size, which may only
go down (the table is lowered with them).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "k3convert"

#: bottom first; a "package" is a top-level module or subpackage of k3convert
LAYERS: list[tuple[str, ...]] = [
    ("k3convert", "presets", "errors", "paths", "device", "config_parse", "units", "native",
     "formats", "layout", "parallel", "synth_tokenizer"),
    ("checkpoint", "arch", "stream"),
    ("quant", "runtime", "shard", "sources", "engines", "targets"),
    ("calibrate", "verify", "inspect", "synth", "serving", "memplan"),
    ("pipeline", "recipe", "demo", "report_html"),
    ("cli", "cli_plan", "cli_convert", "cli_quantize", "cli_options", "__main__"),
]  # fmt: skip
LAYER = {p: i for i, names in enumerate(LAYERS) for p in names}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "k3convert"


def _targets(module: str, path: Path, node) -> list[tuple[str, str | None]]:
    """(imported module, imported name) pairs of one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if node.level:
        base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [(target, a.name) for a in node.names]


def _imports():
    """[(importer, imported module, name, inside a function)] within k3convert."""
    mods = _modules()
    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        local = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, name in _targets(module, path, node):
                if target != "k3convert" and not target.startswith("k3convert."):
                    continue
                if name and f"{target}.{name}" in mods:
                    target, name = f"{target}.{name}", None
                out.append((module, target, name, id(node) in local))
    return out


def test_the_reader_sees_the_package():
    assert len(_modules()) > 50 and len(_imports()) > 500


def test_every_package_has_a_layer():
    missing = sorted({_package(m) for m in _modules()} - set(LAYER))
    assert not missing, f"place these in LAYERS: {missing}"


def test_no_import_points_up():
    up = sorted(
        f"{a} -> {b}" + (" (in a function)" if local else "")
        for a, b, _, local in _imports()
        if LAYER[_package(b)] > LAYER[_package(a)]
    )
    assert not up, "imports into a higher layer:\n" + "\n".join(up)


def test_no_cycle_between_packages():
    graph = defaultdict(set)
    for a, b, _, _ in _imports():
        if _package(a) != _package(b):
            graph[_package(a)].add(_package(b))

    # a cycle between packages shows as an edge from a package into one that reaches it
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(f"{a} <-> {b}" for a in list(graph) for b in graph[a] if a in reach(b))
    assert not cycles, "packages that import each other:\n" + "\n".join(cycles)


def test_no_private_name_crosses_a_package():
    bad = sorted(
        f"{a} imports {b}.{name}"
        for a, b, name, _ in _imports()
        if name and name.startswith("_") and not name.startswith("__")
        and _package(a) != _package(b)
    )  # fmt: skip
    assert not bad, "private names used across packages:\n" + "\n".join(bad)


#: functions over 120 lines and modules over 800 lines still to be split (none left), with
#: their size now: one may shrink or go, none may grow, and no new one may appear
LONG_FUNCTIONS: dict[str, int] = {}
LONG_MODULES: dict[str, int] = {}


def _sizes():
    funcs, mods = {}, {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        mods[rel] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key, n = f"{rel}:{node.name}", node.end_lineno - node.lineno + 1
                funcs[key] = max(n, funcs.get(key, 0))  # same-named ones: the longest
    return funcs, mods


@pytest.mark.parametrize(
    ("kind", "limit", "known"), [("function", 120, LONG_FUNCTIONS), ("module", 800, LONG_MODULES)]
)
def test_sizes_only_shrink(kind, limit, known):
    sizes = _sizes()[0 if kind == "function" else 1]
    bad = [
        f"{name}: {n} lines" + (f" (was {known[name]})" if name in known else " (new)")
        for name, n in sorted(sizes.items())
        if n > limit and n > known.get(name, limit)
    ]
    assert not bad, f"{kind}s over {limit} lines that grew or are new:\n" + "\n".join(bad)
    lower = [f"{name}: {sizes.get(name, 0)} lines, listed as {n}" for name, n in known.items()
             if sizes.get(name, 0) < n]  # fmt: skip
    assert not lower, f"{kind}s that shrank: lower (or drop) them in the table:\n" + "\n".join(
        lower
    )
