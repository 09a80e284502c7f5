"""Recipe files: YAML parsed with ``yaml.safe_load`` into frozen dataclasses.

A recipe says what a conversion does, end to end, so it is validated completely before
anything runs: unknown keys are an error naming the key path (``quantize.rules[1].sheme``)
and the nearest valid key, values are type-checked, scheme names and their options are
resolved against the registry, patterns are compiled, files it names must exist, and
impossible layouts (``moe_tp * moe_ep != tp``) are refused. Schema version 1::

    version: 1                      # optional; the only version so far
    description: Kimi-K2 with int4 routed experts
    source: {path: /models/kimi-k2, model_type: kimi_k2}   # both optional
    quantize:                       # optional: without it tensors stay as released
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
    layout: {tp: 8, pp: 1, moe_ep: 8, redundant_experts: 32, expert_load: calibration}
    output: {compression: zstd, workers: 8, unit_hash: xxh3-128}
    verify: {samples: 2, seq_len: 64, decode: 4, max_kld: 0.05}

A quantize-only recipe of the first format (``description`` + ``quantize``) is a valid
version-1 recipe. A ``calibrate`` / ``auto_keep`` section applies when the command line
(or the API call) gives no ``--calibrate`` / ``--auto-keep`` of its own; one that does
replaces the recipe's section as a whole. Tensors matched by no rule are kept unless
``quantize.scheme`` names a default.

Relative paths in a recipe file (``source.path``, ``layout.expert_load``, ``verify.data``,
``verify.reference``, ``verify.pixel_values``, a ``calibrate.dataset`` that is a path)
are taken from the recipe file's directory, so a recipe and its data move together.
Overrides (``--set layout.tp=8``, :func:`apply_overrides`) are applied to the YAML
document before validation, so a bad override fails like a bad recipe, with its key path.

Reading is defensive (``yaml.safe_load`` semantics through a SafeLoader subclass): a
recipe must be UTF-8 and at most :data:`MAX_RECIPE_BYTES`; nesting deeper than
:data:`MAX_DEPTH` levels and documents that expand (aliases repeating their anchors) to
more than :data:`MAX_NODES` nodes are refused while composing, before anything is
expanded (billion-laughs bombs); duplicate keys are an error naming the key and its
lines. Messages quote a bad value as its type and a short prefix (:func:`short_repr`),
never the whole value.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Sequence
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
class SourceSection:
    """What the recipe converts. ``path``: the checkpoint directory (the command line's
    SRC wins); ``model_type``: the config.json ``model_type`` the recipe was written for
    (a different model is refused before any work)."""

    path: str | None = None
    model_type: str | None = None


@dataclass(frozen=True)
class LayoutSection:
    """The parallel layout of the stream (``shard``'s options). ``moe_tp`` defaults to
    ``tp // moe_ep``; ``pp_layers``: layers per pipeline stage (default: balanced by
    bytes); ``expert_load``: a routing-counts JSON file, or ``calibration`` for the counts
    this conversion's calibration measures, to balance experts over EP ranks;
    ``redundant_experts``: extra replicas of the hottest experts per layer."""

    tp: int = 1
    pp: int = 1
    moe_tp: int | None = None
    moe_ep: int = 1
    pp_layers: tuple[int, ...] = ()
    expert_load: str | None = None
    redundant_experts: int = 0

    def layout(self):
        from .layout import Layout

        return Layout(tp=self.tp, pp=self.pp, moe_tp=self.moe_tp, moe_ep=self.moe_ep)


@dataclass(frozen=True)
class OutputSection:
    """How units are written: ``compression`` (none / zstd), ``workers`` (units and
    tensors in flight; default: the CPUs), ``unit_hash`` (xxh3-128 / sha256). Where they
    will be served: ``serving_device`` (vLLM on cuda / cpu) is checked at the layout's tp
    (:mod:`k3convert.serving`: a warning per tensor it would refuse; ``strict_serving``:
    an error before any work)."""

    compression: str = "none"
    workers: int | None = None
    unit_hash: str = "xxh3-128"
    serving_device: str = "cuda"
    strict_serving: bool = False


@dataclass(frozen=True)
class VerifySection:
    """``verify`` after ``convert``: the candidate stream against ``reference`` (default:
    the source; ``transformers`` for transformers' own model). Inputs: ``data`` (a token
    file) or ``samples`` random sequences of ``seq_len`` tokens, ``pixel_values`` for an
    image; ``decode`` incremental-decode steps; thresholds (None: the per-scheme
    defaults); ``enabled: false`` skips it."""

    enabled: bool = True
    reference: str | None = None
    data: str | None = None
    samples: int = 2
    seq_len: int = 32
    decode: int = 4
    pixel_values: str | None = None
    kv_cache: str | None = None
    max_kld: float | None = None
    min_top1: float | None = None
    max_rel_err: float | None = None
    dtype: str = "fp32"


@dataclass(frozen=True)
class TargetSection:
    """The hardware a recipe is written for: ``device`` (a name ``plan --device`` knows:
    h100, h200, b200, ...; the layout's tp x pp of them) and the workload it assumes,
    ``context`` tokens per sequence x ``batch`` sequences. ``plan --recipe`` takes them as
    its defaults; ``recipe list`` shows them."""

    device: str
    context: int = 131072
    batch: int = 1

    def describe(self, layout: LayoutSection) -> str:
        """``16 x h200, 128K tokens x 4``."""
        n = layout.tp * layout.pp
        ctx = f"{self.context // 1024}K" if self.context % 1024 == 0 else str(self.context)
        return f"{n} x {self.device}, {ctx} tokens x {self.batch}"


#: the recipe schema versions this release reads
VERSIONS = (1,)


@dataclass(frozen=True)
class Recipe:
    version: int = 1
    description: str = ""
    source: SourceSection = field(default_factory=SourceSection)
    quantize: QuantizeSection | None = None
    layout: LayoutSection = field(default_factory=LayoutSection)
    output: OutputSection = field(default_factory=OutputSection)
    verify: VerifySection = field(default_factory=VerifySection)
    target: TargetSection | None = None
    #: where the recipe came from (a file path, a preset, ``<recipe>``); not part of it
    origin: str = field(default="<recipe>", compare=False)

    def require_quantize(self) -> QuantizeSection:
        """The quantize section, for the commands that need one."""
        if self.quantize is None:
            raise ConfigError(
                f"{self.origin}: the recipe has no quantize section, so it keeps every tensor "
                f"as released; `k3convert quantize` needs quantize.rules or quantize.scheme "
                f"(`k3convert convert` runs such a recipe: shard + verify)."
            )
        return self.quantize


_SKIP = {"origin"}

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
            close = difflib.get_close_matches(_key_text(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else "."
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
    r = _build(Recipe, data, "", source)
    r = dataclasses.replace(r, origin=source)
    r = _resolve_paths(r, Path(base) if base is not None else None)
    _validate(r)
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
    if not p.is_file() and str(path) in presets():
        p = presets()[str(path)]
    data = _load_yaml(read_recipe_text(p), str(p))
    data = apply_overrides(data, overrides, str(p))
    return parse_recipe(data, str(p), base=p.resolve().parent)


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
            value = _load_yaml(text, f"--set {key}") if text.strip() else None
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
    if key == "quantize.calibrate.dataset":
        from .calibrate.data import looks_like_path

        if not (looks_like_path(value) or Path(value).exists()):
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
    src = r.origin
    if r.quantize is not None:
        _validate_quantize(r.quantize, src)
    _validate_layout(r.layout, src)
    o = r.output
    from .stream import hashing
    from .stream.format import COMPRESSIONS

    _choice(o.compression, COMPRESSIONS, f"{src}: output.compression")
    _choice(o.unit_hash, hashing.ALGORITHMS, f"{src}: output.unit_hash")
    from .serving import DEVICES

    _choice(o.serving_device, DEVICES, f"{src}: output.serving_device")
    if o.workers is not None and o.workers < 1:
        raise ConfigError(f"{src}: output.workers must be at least 1, got {o.workers}.")
    if r.target is not None:
        from .memplan import DEVICES

        _choice(r.target.device, tuple(DEVICES), f"{src}: target.device")
        for k in ("context", "batch"):
            if getattr(r.target, k) < 1:
                raise ConfigError(f"{src}: target.{k} must be at least 1, got "
                                  f"{getattr(r.target, k)}.")  # fmt: skip
    v = r.verify
    for k in ("samples", "seq_len"):
        if getattr(v, k) < 1:
            raise ConfigError(f"{src}: verify.{k} must be at least 1, got {getattr(v, k)}.")
    if v.decode < 0:
        raise ConfigError(f"{src}: verify.decode must be 0 or more, got {v.decode}.")
    _choice(v.dtype, ("fp32", "bf16", "fp16"), f"{src}: verify.dtype")
    if v.kv_cache is not None:
        _choice(v.kv_cache, ("fp8",), f"{src}: verify.kv_cache")
    for k in ("max_kld", "max_rel_err"):
        x = getattr(v, k)
        if x is not None and not (x >= 0 and x == x and x != float("inf")):
            raise ConfigError(f"{src}: verify.{k} must be a finite number >= 0, got {x}.")
    if v.min_top1 is not None and not 0 <= v.min_top1 <= 1:
        raise ConfigError(f"{src}: verify.min_top1 is a fraction in [0, 1], got {v.min_top1}.")
    for k in ("data", "pixel_values"):
        _must_exist(getattr(v, k), f"{src}: verify.{k}")
    if v.reference not in (None, "transformers"):
        _must_exist(v.reference, f"{src}: verify.reference")
    if r.layout.expert_load not in (None, CALIBRATION):
        _must_exist(r.layout.expert_load, f"{src}: layout.expert_load")
    if r.layout.expert_load == CALIBRATION and (r.quantize is None or r.quantize.calibrate is None):
        raise ConfigError(
            f"{src}: layout.expert_load: 'calibration' takes the routing counts measured "
            f"by calibration, but the recipe has no quantize.calibrate section; add one or "
            f"give a routing-counts JSON file."
        )
    if r.source.path is not None:
        _must_exist(r.source.path, f"{src}: source.path")


#: ``layout.expert_load`` value: the routing counts this conversion's calibration measures
CALIBRATION = "calibration"


def _validate_layout(lay: LayoutSection, src: str) -> None:
    from .layout import MAX_DEGREE

    for k in ("tp", "pp", "moe_ep", "moe_tp", "redundant_experts"):
        v = getattr(lay, k)
        if v is not None and v > MAX_DEGREE:
            raise ConfigError(
                f"{src}: layout.{k}={v} is beyond any cluster (at most {MAX_DEGREE}); check "
                f"the value."
            )
    for k in ("tp", "pp", "moe_ep"):
        if getattr(lay, k) < 1:
            raise ConfigError(f"{src}: layout.{k} must be at least 1, got {getattr(lay, k)}.")
    if lay.moe_tp is not None and lay.moe_tp < 1:
        raise ConfigError(f"{src}: layout.moe_tp must be at least 1, got {lay.moe_tp}.")
    if lay.moe_tp is None and lay.tp % lay.moe_ep:
        from .layout import divisors

        raise ConfigError(
            f"{src}: layout.moe_ep={lay.moe_ep} must divide layout.tp={lay.tp} (experts are "
            f"spread over the tensor-parallel ranks); legal values: {divisors(lay.tp)}."
        )
    if lay.moe_tp is not None and lay.moe_tp * lay.moe_ep != lay.tp:
        raise ConfigError(
            f"{src}: layout.moe_tp * layout.moe_ep must equal layout.tp, got {lay.moe_tp} * "
            f"{lay.moe_ep} != {lay.tp}; e.g. moe_tp: {max(1, lay.tp // lay.moe_ep)}."
        )
    if lay.redundant_experts < 0:
        raise ConfigError(
            f"{src}: layout.redundant_experts must be 0 or more, got {lay.redundant_experts}."
        )
    if lay.pp_layers:
        if len(lay.pp_layers) != lay.pp:
            raise ConfigError(
                f"{src}: layout.pp_layers has {len(lay.pp_layers)} stage(s) but layout.pp is "
                f"{lay.pp}; give one layer count per stage."
            )
        if min(lay.pp_layers) < 0:
            raise ConfigError(f"{src}: layout.pp_layers: layer counts must be 0 or more.")


def _choice(value: str, allowed, where: str) -> None:
    if value in allowed:
        return
    close = difflib.get_close_matches(_key_text(value), list(allowed), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"{where}: '{_key_text(value)}' is not one of {', '.join(allowed)}.{hint}")


def _must_exist(path: str | None, where: str) -> None:
    if path is not None and not Path(path).exists():
        raise ConfigError(f"{where}: {path} does not exist; fix the path in the recipe.")


def _validate_quantize(q: QuantizeSection, src: str) -> None:
    from .quant.rules import KEEP, check_pattern
    from .quant.schemes import get_scheme

    if q.scheme is not None:
        _scheme(get_scheme, q.scheme, {}, f"{src}: quantize.scheme")
    for i, rule in enumerate(q.rules):
        where = f"{src}: quantize.rules[{i}]"
        if rule.scheme != KEEP:
            _check_options(get_scheme, rule, f"quantize.rules[{i}]", src)
            _scheme(get_scheme, rule.scheme, rule.options, where)
        elif rule.options:
            raise ConfigError(f"{where}: a 'keep' rule takes no options.")
        for p in rule.match:
            check_pattern(p, f"{where}.match")
    for i, p in enumerate(q.keep):
        check_pattern(p, f"{src}: quantize.keep[{i}]")
    if not q.rules and q.scheme is None:
        raise ConfigError(
            f"{src}: quantize needs 'rules' or a default 'scheme'; as written it would keep "
            f"every tensor (leave the quantize section out to convert without quantizing)."
        )
    if q.calibrate is not None:
        from .calibrate.data import resolve_dataset
        from .calibrate.sequential import ALGORITHMS

        where = f"{src}: quantize.calibrate"
        if q.calibrate.algorithm not in ALGORITHMS:
            close = difflib.get_close_matches(q.calibrate.algorithm, ALGORITHMS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where}.algorithm: '{_key_text(q.calibrate.algorithm)}' is not known; use "
                f"one of {', '.join(ALGORITHMS)}.{hint}"
            )
        try:
            opts = q.calibrate.options()
            opts.check()
            # the command line's cross-option checks, in the recipe's keys
            opts.check_applicable(q.calibrate.algorithm, opts.set_options(),
                                  lambda k: f"quantize.calibrate.{k}")  # fmt: skip
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        try:
            resolve_dataset(q.calibrate.dataset)
        except ConfigError as e:
            raise ConfigError(f"{where}.dataset: {e}") from None
    if q.auto_keep is not None:
        from .calibrate.sensitivity import METHODS, parse_budget

        where = f"{src}: quantize.auto_keep"
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
        from .calibrate.data import looks_like_path

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
    from .paths import data_dirs

    return data_dirs(ENV_RECIPES, "recipes")


def presets() -> dict[str, Path]:
    """Preset name (file stem) -> recipe file, first directory of :func:`recipe_dirs` wins."""
    out: dict[str, Path] = {}
    for d in recipe_dirs():
        for f in sorted(d.glob("*.yaml")):
            out.setdefault(f.stem, f)
    return out


def preset_path(name: str) -> Path:
    known = presets()
    if name in known:
        return known[name]
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"no preset recipe named '{_key_text(name)}'.{hint} Presets: "
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
            return {f.name: conv(getattr(v, f.name)) for f in fields(v) if f.name not in _SKIP}
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
