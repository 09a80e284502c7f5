"""A parsed recipe checked as a whole: scheme names and options against the registry,
patterns compiled, layouts that cannot exist, the calibration and auto-keep sections
(:func:`calibrate_section` / :func:`auto_keep_section`, which ``quantize``'s flags go
through too, so a flag and a recipe key get the same checks), files that must exist."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from .. import targets
from ..calibrate.data import resolve_dataset
from ..calibrate.options import ALGORITHMS, Name, option_name
from ..calibrate.sensitivity import METHODS, parse_budget
from ..errors import ConfigError, short_repr
from ..layout import MAX_DEGREE, divisors
from ..memplan import DEVICES as PLAN_DEVICES
from ..quant.rules import KEEP, check_pattern, check_role_names, known_role_names, make_rule
from ..quant.schemes import get_scheme
from ..serving import AUTO as SERVING_AUTO
from ..serving import DEVICES as SERVING_DEVICES
from ..stream import hashing
from ..stream.format import COMPRESSIONS
from .build import build, convert, key_text
from .sections import (
    CALIBRATION,
    AutoKeepSection,
    CalibrateSection,
    LayoutSection,
    QuantizeSection,
    Recipe,
    RuleSpec,
)


def check_model_type(r: Recipe, config: dict, root) -> None:
    """The source is the model the recipe was written for (``source.model_type``)."""
    mt = config.get("model_type")
    if r.source.model_type is not None and mt != r.source.model_type:
        raise ConfigError(
            f"{r.origin}: source.model_type is '{r.source.model_type}' but {root}/config.json "
            f"says '{mt}'; this recipe was written for another model (change or drop "
            f"source.model_type)."
        )


def validate(r: Recipe) -> None:
    src = r.origin
    if r.quantize is not None:
        _validate_quantize(r.quantize, src, r.source.model_type)
    _validate_layout(r.layout, src)
    o = r.output
    _choice(o.compression, COMPRESSIONS, f"{src}: output.compression")
    _choice(o.unit_hash, hashing.ALGORITHMS, f"{src}: output.unit_hash")
    _choice(o.serving_device, (SERVING_AUTO, *SERVING_DEVICES), f"{src}: output.serving_device")
    _choice(o.format, targets.names(), f"{src}: output.format")
    if o.workers is not None and o.workers < 1:
        raise ConfigError(f"{src}: output.workers must be at least 1, got {o.workers}.")
    if r.target is not None:
        _choice(r.target.device, tuple(PLAN_DEVICES), f"{src}: target.device")
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


def _validate_layout(lay: LayoutSection, src: str) -> None:
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
    close = difflib.get_close_matches(key_text(value), list(allowed), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"{where}: '{key_text(value)}' is not one of {', '.join(allowed)}.{hint}")


def _must_exist(path: str | None, where: str) -> None:
    if path is not None and not Path(path).exists():
        raise ConfigError(f"{where}: {path} does not exist; fix the path in the recipe.")


def _validate_quantize(q: QuantizeSection, src: str, model_type: str | None) -> None:
    if q.scheme is not None:
        _scheme(get_scheme, q.scheme, {}, f"{src}: quantize.scheme")
    for i, rule in enumerate(q.rules):
        where = f"{src}: quantize.rules[{i}]"
        if rule.scheme != KEEP:
            _check_options(get_scheme, rule, f"quantize.rules[{i}]", src)
            _scheme(get_scheme, rule.scheme, rule.options, where)
        elif rule.options:
            raise ConfigError(f"{where}: a 'keep' rule takes no options.")
        if rule.roles:
            check_role_names([make_rule(rule.scheme, roles=rule.roles, where=where)],
                             role_names(model_type))  # fmt: skip
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
        check_calibrate(q.calibrate, f"{src}: quantize.calibrate")
    if q.auto_keep is not None:
        check_auto_keep(q.auto_keep, f"{src}: quantize.auto_keep")


def role_names(model_type: str | None) -> set[str]:
    """The role names a rule may use, known before any checkpoint is read: the components,
    their aliases, and the tensor kinds in the tables of ``model_type``'s architecture
    (of every architecture when the recipe names none, or one without a bundled preset:
    the checkpoint's own check then narrows them), read from the bundled presets'
    configs. ``convert`` checks the same names against the source's own tensors."""
    from ..arch import base as arch_base
    from ..synth import PRESETS, preset_config

    want = None
    if model_type is not None:
        try:
            want = arch_base.get_arch(model_type)
        except ConfigError:
            want = None
    by_arch: dict[str, set[str]] = {}
    for name in PRESETS:
        raw = preset_config(name)
        arch = arch_base.arch_for_config(raw, name)
        by_arch.setdefault(arch.name, set()).update(s.kind for s in arch.specs(arch.config(raw)))
    if want is not None and want.name in by_arch:
        kinds = by_arch[want.name]
    else:  # no preset of that architecture: any architecture's kinds
        kinds = set().union(*by_arch.values())
    return known_role_names(()) | kinds


def calibrate_section(
    data: Mapping[str, Any], *, name: Name, given: Collection[str] | None = None
) -> CalibrateSection:
    """A ``quantize.calibrate`` section from options given elsewhere than a recipe file
    (``quantize``'s flags), checked as a recipe's is: ``name(key)`` spells a key in the
    messages (a flag), ``given`` the keys the user set (default: those in ``data``)."""
    section = build(CalibrateSection, dict(data), "quantize.calibrate", "quantize")
    check_calibrate(section, None, name, set(data) if given is None else given)
    return section


def check_calibrate(
    c: CalibrateSection, where: str | None, name: Name | None = None,
    given: Collection[str] | None = None,
) -> None:  # fmt: skip
    """A calibration section's checks: the algorithm's name, every option's value
    (:meth:`~k3convert.calibrate.options.SequentialOptions.check`), the options the
    algorithm or observer would not use (``given``; default: those that differ from
    their defaults), the dataset. ``where``: a recipe's ``FILE: quantize.calibrate``
    (keys spelled as its key paths); None: ``name`` spells them (flags)."""

    def at(key: str) -> str:
        return f"{where}.{key}" if where else name(key)

    if c.algorithm not in ALGORITHMS:
        close = difflib.get_close_matches(c.algorithm, ALGORITHMS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{at('algorithm')}: '{key_text(c.algorithm)}' is not known; use "
            f"one of {', '.join(ALGORITHMS)}.{hint}"
        )
    opts = c.options()
    try:
        opts.check(option_name if where else name)
        opts.check_applicable(c.algorithm, opts.set_options() if given is None else given,
                              name or (lambda k: f"quantize.calibrate.{k}"))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None
    try:
        resolve_dataset(c.dataset)
    except ConfigError as e:
        raise ConfigError(f"{at('dataset')}: {e}") from None


def auto_keep_section(data: Mapping[str, Any], *, name: Name) -> AutoKeepSection:
    """A ``quantize.auto_keep`` section from ``quantize``'s flags, checked as a recipe's."""
    section = build(AutoKeepSection, dict(data), "quantize.auto_keep", "quantize")
    check_auto_keep(section, None, name)
    return section


def check_auto_keep(a: AutoKeepSection, where: str | None, name: Name | None = None) -> None:
    """The budget, the ladder scheme, the sensitivity method."""
    try:
        parse_budget(a.budget)
        if a.scheme is not None:
            get_scheme(a.scheme)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None
    if a.sensitivity not in METHODS:
        raise ConfigError(
            f"{f'{where}.sensitivity' if where else name('sensitivity')}: "
            f"'{key_text(a.sensitivity)}' is not known; use one of {', '.join(METHODS)}."
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
        kp = f"{path}.options.{key_text(key)}"
        if not isinstance(key, str) or key not in allowed:
            close = difflib.get_close_matches(key_text(key), list(allowed), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{src}: unknown key '{kp}': scheme '{rule.scheme}' has no option "
                f"'{key_text(key)}'.{hint} "
                f"Its options: {', '.join(allowed) or 'none'}."
            )
        convert(value, hints[key], kp, src)


def _scheme(get_scheme, name: str, options: dict, where: str) -> None:
    try:
        get_scheme(name, **options)
    except ConfigError as e:
        raise type(e)(f"{where}: {e}") from e
    except TypeError as e:  # option of the wrong type
        raise ConfigError(f"{where}: bad options {short_repr(options)} ({e}).") from e
