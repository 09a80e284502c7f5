"""How a checkpoint's tensors are planned: each tensor's decision (scheme, keep, kept as
stored) from rules, and the parts each row writes. Reads headers only."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch

from .. import formats as fmt
from ..arch import resolve as resolve_arch
from ..arch import validate_source
from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import ConfigError, short_repr
from ..formats import ACTIVATION_PARTS
from ..formats.dtypes import FLOAT_DTYPES
from . import mx_int4
from .rules import Decision, Plan, Rule, TensorInfo, make_rule, resolve
from .schemes import IntScheme, get_scheme, known_schemes


def config_dtype(config: dict) -> torch.dtype:
    t = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    name = str(t.get("dtype") or t.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return FLOAT_DTYPES.get(name, torch.bfloat16)


def tensor_infos(ckpt, roles) -> list[TensorInfo]:
    dtype = config_dtype(ckpt.config)
    out = []
    for n in ckpt.names():
        m = ckpt.meta(n)
        encoded = m.encoding != "plain"
        out.append(
            TensorInfo(
                n, tuple(m.shape), roles[n], m.storage, encoded, m.nbytes,
                dtype if encoded else m.dtype,
            )
        )  # fmt: skip
    return out


def recipe_rules(r) -> tuple[list[Rule], str | None, list[str], bool | None]:
    """(rules, default scheme name, keep patterns, default_keep) of a loaded recipe's
    quantize section (:class:`k3convert.recipe.Recipe`)."""
    q = r.require_quantize()
    rules = [
        make_rule(x.scheme, x.match, x.roles, x.options, where=f"{r.origin}: quantize.rules[{i}]")
        for i, x in enumerate(q.rules)
    ]
    return rules, q.scheme, list(q.keep), q.default_keep


def plan_quantization(
    *,
    src: str | os.PathLike,
    scheme: str | None = None,
    recipe=None,
    keep: Sequence[str] = (),
    default_keep: bool = True,
    kept_as_stored: bool = True,
    weight_observer: str | None = None,
):
    """(checkpoint, plan): open the source (a path, or a :class:`Checkpoint` already
    open) and resolve every tensor; reads no data.
    recipe: a loaded :class:`k3convert.recipe.Recipe` (its quantize section's rules).
    kept_as_stored: kept encoded tensors stay in their release format when a scheme
    describes it (False: written dequantized in the config dtype). weight_observer:
    ``minmax`` | ``mse``, set on every integer scheme of the plan (see
    :class:`~.schemes.IntScheme`); None keeps the schemes' own."""
    if (scheme is None) == (recipe is None):
        raise ConfigError("give exactly one of --scheme NAME or --recipe R.yaml.")
    rules: list[Rule] = []
    default = None
    keep = list(keep)
    if recipe is not None:
        rules, default_name, rkeep, rdefault_keep = recipe_rules(recipe)
        default = get_scheme(default_name) if default_name else None
        keep = rkeep + keep
        if rdefault_keep is False:
            default_keep = False
    else:
        default = get_scheme(scheme)
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    arch, cfg = resolve_arch(ckpt.config, f"{ckpt.root}/config.json")
    matched = validate_source(arch, cfg, ckpt, str(ckpt.root))
    roles = {n: m.role for n, m in matched.items()}
    plan = resolve(
        tensor_infos(ckpt, roles),
        arch=arch.name,
        rules=rules,
        default=default,
        keep=keep,
        default_keep=default_keep,
        unstored=tied_linears(arch, cfg),
    )
    if kept_as_stored:
        plan.rows = [keep_as_stored(ckpt, r) for r in plan.rows]
    if weight_observer is not None:
        plan.rows = with_observer(plan, weight_observer)
    else:
        plan.rows = mx_search(ckpt, plan)
    return ckpt, plan


def mx_search(ckpt, plan: Plan) -> list:
    """The plan's rows, every MXFP4 source under a minmax int4 scheme that
    :mod:`.mx_int4` produces switched to its per-group scale search (the default for an
    MXFP4 release: its minmax scales move values the search keeps)."""
    rows = []
    for r in plan.rows:
        s = r.scheme
        if (not r.kept and not r.as_stored and isinstance(s, IntScheme) and s.observer == "minmax"
                and mx_int4.applies(s) and ckpt.meta(r.name).encoding == fmt.MXFP4):  # fmt: skip
            r = dataclasses.replace(r, scheme=dataclasses.replace(s, observer="search"))
        rows.append(r)
    return rows


def with_observer(plan: Plan, observer: str) -> list:
    """The plan's rows with the weight observer of every scheme that takes one (its
    ``support.observers``: integer and FP4) set to ``observer`` (FP8 scales have no
    search: those rows keep theirs)."""
    if observer not in ("minmax", "mse"):
        raise ConfigError(f"weight observer must be minmax or mse, not {short_repr(observer)}.")
    ints = [r for r in plan.quantized
            if "mse" in r.scheme.support.observers and not r.as_stored]  # fmt: skip
    if not ints:
        used = sorted({r.scheme.name for r in plan.quantized}) or ["none: every tensor is kept"]
        raise ConfigError(
            f"the weight observer ({observer}) chooses integer and FP4 scales; no tensor of "
            f"this plan is quantized to such a scheme (schemes: {', '.join(used)}). Use an "
            f"int or FP4 scheme (w4a16, w8a8, int4-g128, nvfp4a16, nvfp4, ...) or drop "
            f"--weight-observer."
        )
    cache: dict = {}
    rows = []
    chosen = {id(r) for r in ints}
    for r in plan.rows:
        if id(r) in chosen:
            new = cache.setdefault(r.scheme, dataclasses.replace(r.scheme, observer=observer))
            r = dataclasses.replace(r, scheme=new)
        rows.append(r)
    return rows


@functools.lru_cache(maxsize=1)
def _weight_only_schemes() -> dict[str, tuple]:
    """Registered weight-only schemes by the format they write (built once)."""
    out: dict[str, list] = {}
    for name in known_schemes():
        s = get_scheme(name)
        if s.act is None:
            out.setdefault(s.format, []).append(s)
    return {k: tuple(v) for k, v in out.items()}


def keep_as_stored(ckpt, r: Decision) -> Decision:
    """``r`` as a copy of its stored parts when it is kept, encoded, and some registered
    weight-only scheme has exactly those parts (names, dtypes, shapes) and bit width."""
    if not (r.kept and r.encoded):
        return r
    m = ckpt.meta(r.name)
    stored = {k: (pm.dtype, tuple(pm.shape)) for k, pm in m.parts.items()}
    if any(k in ACTIVATION_PARTS for k in stored) or len(r.shape) != 2:
        return r
    for s in _weight_only_schemes().get(m.encoding, ()):
        want = {k: (d, tuple(sh)) for k, d, sh in s.parts(r.shape)}
        bits = s.weight_args().get("num_bits")
        if want == stored and m.quant.num_bits in (None, bits):
            return dataclasses.replace(
                r, scheme=s, as_stored=True, out_bytes=r.src_bytes,
                reason=f"{r.reason}; kept as stored ({m.encoding})",
            )  # fmt: skip
    return r


def tied_linears(arch, cfg) -> list[str]:
    """Linear modules the model builds but the checkpoint does not store because they are
    tied to another tensor (lm_head with ``tie_word_embeddings``): the rows the
    architecture table has only when untied. They run in the source precision, so the
    quantization_config must ignore them, or a loader targeting ``Linear`` builds them
    quantized with no scales."""
    if not getattr(cfg, "tie_word_embeddings", False) or not dataclasses.is_dataclass(cfg):
        return []
    have = {s.pattern for s in arch.table(cfg)}
    untied = arch.table(dataclasses.replace(cfg, tie_word_embeddings=False))
    return [
        s.pattern.removesuffix(".weight")
        for s in untied
        if s.pattern not in have and s.scope == "global" and s.pattern.endswith(".weight")
        and len(s.shape(cfg)) == 2 and s.component not in ("embeddings", "norms")
    ]  # fmt: skip


def row_entries(r: Decision) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if r.kept:
        return [(r.name, r.out_dtype, r.shape)]
    base = r.module
    e = [(f"{base}.{k}", d, s) for k, d, s in r.scheme.parts(r.shape)]
    e += [(f"{base}.{k}", d, s) for k, d, s in r.scheme.act_parts()]
    return e
