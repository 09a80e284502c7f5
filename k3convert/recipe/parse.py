"""Recipe files into a validated :class:`~.sections.Recipe` (``load_recipe``,
``parse_recipe``), back into YAML (``dump_recipe``), and the preset recipes."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from ..calibrate.data import looks_like_path
from ..errors import ConfigError, short_repr
from ..paths import data_dirs
from .build import SKIP, build, key_text
from .checks import validate
from .sections import CALIBRATION, VERSIONS, Recipe
from .yaml_io import apply_overrides, load_yaml, read_recipe_text


def parse_recipe(
    data: Any, source: str = "<recipe>", *, base: str | os.PathLike | None = None
) -> Recipe:
    """A validated Recipe from a parsed YAML document (dict). ``base``: the directory
    relative paths are taken from (a recipe file's own; default: the working directory)."""
    if isinstance(data, dict) and "version" in data:
        v = data["version"]
        if isinstance(v, bool) or v not in VERSIONS:
            raise ConfigError(
                f"{source}: 'version' {short_repr(v)} is not a recipe schema version this "
                f"k3convert reads ({', '.join(map(str, VERSIONS))}); upgrade k3convert or "
                f"write the recipe for version {VERSIONS[-1]}."
            )
    if isinstance(data, dict) and isinstance(data.get("quantize"), dict):
        _old_keys(data["quantize"], source)
    r = build(Recipe, data, "", source)
    r = dataclasses.replace(r, origin=source)
    r = _resolve_paths(r, Path(base) if base is not None else None)
    validate(r)
    return r


def _old_keys(q: dict, src: str) -> None:
    """Keys a quantize section may carry from before the layout / output / verify
    sections existed: say where they went."""
    moved = {"tp": "layout.tp", "pp": "layout.pp", "ep": "layout.moe_ep",
             "compress": "output.compression", "workers": "output.workers"}  # fmt: skip
    for k, to in moved.items():
        if k in q:
            raise ConfigError(
                f"{src}: 'quantize.{k}' is not a quantize option; since recipe version 1 it "
                f"is '{to}' (move it to that section)."
            )


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a recipe YAML file (``yaml.safe_load`` semantics, bounded: see
    the module doc), with ``--set KEY=VALUE`` overrides applied first. ``path`` may
    also name a preset of :func:`presets` (``k3k-day0``)."""
    p = Path(path)
    if not p.is_file():
        known = presets()
        if str(path) in known:
            p = known[str(path)]
        elif not p.exists():
            raise ConfigError(f"{key_text(str(path))}: {_no_recipe(p, known)}")
    data = load_yaml(read_recipe_text(p), str(p))
    merged = apply_overrides(data, overrides, str(p))
    try:
        return parse_recipe(merged, str(p), base=p.resolve().parent)
    except ConfigError as e:
        if not overrides:
            raise
        raise _blame_overrides(e, data, overrides, p) from None


def _blame_overrides(e: ConfigError, data, overrides: Sequence[str], p: Path) -> ConfigError:
    """The error of a recipe made invalid by ``--set``: the file's own when the file alone
    fails the same way, else the ``--set`` it comes from (the one whose key the message
    names, or all of them), the file named after it."""
    try:
        parse_recipe(data, str(p), base=p.resolve().parent)
        alone = None
    except ConfigError as e0:
        alone = str(e0)
    if alone == str(e):
        return e
    msg = str(e).removeprefix(f"{p}: ")
    keys = [str(o).partition("=")[0].strip() for o in overrides]
    named = [o for o, k in zip(overrides, keys, strict=True) if k and k in msg]
    culprit = ", --set ".join(named or overrides)
    return ConfigError(f"--set {culprit}: {msg.rstrip('.')} (in recipe {p}).")


def _resolve_paths(r: Recipe, base: Path | None) -> Recipe:
    """Relative paths of a recipe file taken from its directory (``base``)."""
    if base is None:
        return r

    def fix(p: str | None, keep=()) -> str | None:
        if p is None or p in keep:
            return p
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else base / q)

    rep = dataclasses.replace
    r = rep(r, source=rep(r.source, path=fix(r.source.path)))
    lay = rep(r.layout, expert_load=fix(r.layout.expert_load, (CALIBRATION,)))
    v = rep(r.verify, data=fix(r.verify.data), pixel_values=fix(r.verify.pixel_values),
            reference=fix(r.verify.reference, ("transformers",)))  # fmt: skip
    q = r.quantize
    if q is not None and q.calibrate is not None:
        cal = q.calibrate
        ds = str(cal.dataset)
        if looks_like_path(ds) or (base / ds).exists():
            cal = rep(cal, dataset=fix(ds))
        if cal.offload_dir is not None:
            cal = rep(cal, offload_dir=fix(str(cal.offload_dir)))
        q = rep(q, calibrate=cal)
    if q is not None and q.auto_keep is not None and q.auto_keep.plot is not None:
        q = rep(q, auto_keep=rep(q.auto_keep, plot=fix(q.auto_keep.plot)))
    return rep(r, layout=lay, verify=v, quantize=q)


# -- presets and printing ---------------------------------------------------------------
#: where preset recipes live: ``$K3CONVERT_RECIPES_DIR``, the source checkout's
#: ``recipes/``, then ``<prefix>/share/k3convert/recipes`` (a wheel's data-files)
ENV_RECIPES = "K3CONVERT_RECIPES_DIR"


def recipe_dirs() -> list[Path]:
    return data_dirs(ENV_RECIPES, "recipes")


def presets() -> dict[str, Path]:
    """Preset name (file stem) -> recipe file, first directory of :func:`recipe_dirs` wins."""
    out: dict[str, Path] = {}
    for d in recipe_dirs():
        for f in sorted(d.glob("*.yaml")):
            out.setdefault(f.stem, f)
    return out


def _no_recipe(p: Path, known: dict[str, Path]) -> str:
    """Why a recipe argument names nothing, with the closest preset."""
    name = p.stem if p.suffix in (".yaml", ".yml") else p.name
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" Did you mean the preset '{close[0]}'?" if close else ""
    return (
        f"no such recipe file, and no preset of that name.{hint} `k3convert recipe list` "
        f"lists the presets."
    )


def preset_path(name: str) -> Path:
    known = presets()
    if name in known:
        return known[name]
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"no preset recipe named '{key_text(name)}'.{hint} Presets: "
        f"{', '.join(known) or 'none found (set ' + ENV_RECIPES + ')'}."
    )


def preset_summary(path: Path) -> str:
    """A preset's one-line description (its ``description``, else its first comment)."""
    try:
        r = load_recipe(path)
    except ConfigError as e:
        return f"(invalid: {e})"
    desc = r.description
    if desc:
        where = f" [target: {r.target.describe(r.layout)}]" if r.target is not None else ""
        return " ".join(desc.split()) + where
    for line in read_recipe_text(path).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def recipe_to_dict(r: Recipe) -> dict:
    """The resolved recipe as plain YAML-able data (every default filled in); parsing
    it gives the same Recipe back."""

    def conv(v):
        if is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in fields(v) if f.name not in SKIP}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        return v

    out = conv(r)
    if out.get("target") is None:  # optional: absent, as before the section existed
        out.pop("target", None)
    return out


def dump_recipe(r: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(r), sort_keys=False, default_flow_style=None)
