"""Which tensor gets which scheme: ordered rules over names and roles, and the plan.

Decisions, first that applies wins:

1. ``--keep PATTERN`` (user keeps) -> kept;
2. the architecture's default exceptions (``Role.keep``: embeddings, lm_head, norms,
   MoE router and its bias, vision patch / position embedding, MTP layers) -> kept,
   unless ``default_keep=False``;
3. tensors that are not Linear weights (1-D, biases, embeddings, convolutions) -> kept;
4. recipe rules in order: a rule applies when its ``match`` patterns (glob, or ``re:``
   regex matched from the start; tried on the tensor and its module name) and its
   ``roles`` (component, alias such as ``experts``, or kind such as ``q_proj``) all
   match; its scheme may be ``keep``;
5. the default scheme (``--scheme``), else kept.

The resolved :class:`Plan` is what ``quantize --dry-run`` prints and what the writer
executes; it also derives compressed-tensors ``config_groups`` targets and ``ignore``
with layer / expert indices generalised into regexes, so the config stays small for a
model with 100 k expert tensors.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..arch.base import COMPONENTS, Role
from ..errors import ConfigError, short_repr
from .schemes import GroupSizeError, Scheme, get_scheme

KEEP = "keep"

#: friendly role names -> components
ROLE_ALIASES = {
    "experts": "routed_experts",
    "routed": "routed_experts",
    "moe": "routed_experts",
    "shared": "shared_experts",
    "attn": "attention",
    "mlp": "dense_mlp",
    "dense": "dense_mlp",
    "lm_head": "head",
    "embed": "embeddings",
    "gate": "router",
}

#: kinds that are stored as ``.weight`` but are not Linear layers
NON_LINEAR_KINDS = {"embed_tokens", "mtp_embed_tokens", "pos_emb", "patch_embed"}


def pattern_matches(pattern: str, *names: str) -> bool:
    """Glob (fnmatch, ``*`` crosses dots) or ``re:`` regex (re.match) on any of names."""
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return any(rx.match(n) for n in names)
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def check_pattern(pattern: str, where: str) -> None:
    """A glob or ``re:`` pattern that compiles; the error names ``where`` (also in its
    ``where`` field)."""
    if not isinstance(pattern, str) or not pattern:
        err = ConfigError(
            f"{where}: a pattern must be a non-empty string, got {short_repr(pattern)}."
        )
        err.where = where
        raise err
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            shown = repr(pattern) if len(pattern) <= 60 else short_repr(pattern)
            err = ConfigError(f"{where}: invalid regex {shown} ({e}).")
            err.where = where
            raise err from e


#: components that a broader role also names: a rule for ``attention`` (or ``attn``)
#: covers a hybrid model's KDA layers as well as its MLA / GQA ones
ROLE_PARENTS = {"linear_attention": ("attention", "attn", "kda")}


def role_names(role: Role) -> set[str]:
    names = {role.component, role.kind}
    names |= {a for a, c in ROLE_ALIASES.items() if c == role.component}
    names |= set(ROLE_PARENTS.get(role.component, ()))
    if role.component in ("vision", "projector"):
        names.add("vision")
    return names


@dataclass(frozen=True)
class Rule:
    """One ordered rule. scheme: a registered name or 'keep'; options: scheme overrides."""

    scheme: str
    match: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    options: tuple[tuple[str, object], ...] = ()
    where: str = ""

    def applies(self, name: str, role: Role) -> bool:
        module = name.removesuffix(".weight")
        if self.match and not any(pattern_matches(p, name, module) for p in self.match):
            return False
        return not (self.roles and not (set(self.roles) & role_names(role)))

    def resolve(self) -> Scheme | None:
        if self.scheme == KEEP:
            return None
        return get_scheme(self.scheme, **dict(self.options))

    def label(self) -> str:
        bits = []
        if self.match:
            bits.append("match=" + ",".join(self.match))
        if self.roles:
            bits.append("roles=" + ",".join(self.roles))
        return f"{self.where or 'rule'} ({' '.join(bits) or 'all'})"


def make_rule(
    scheme: str,
    match: str | Sequence[str] | None = None,
    roles: str | Sequence[str] | None = None,
    options: Mapping | None = None,
    where: str = "",
) -> Rule:
    m = (match,) if isinstance(match, str) else tuple(match or ())
    r = (roles,) if isinstance(roles, str) else tuple(roles or ())
    for p in m:
        check_pattern(p, where or "rule")
    return Rule(scheme, m, r, tuple(sorted((options or {}).items())), where)


@dataclass(frozen=True)
class Decision:
    """What happens to one logical tensor.

    scheme: None when kept; reason: why (rule, keep pattern, default exception);
    src_bytes: bytes stored in the source; out_bytes: bytes written. as_stored: a kept
    tensor whose source encoding is exactly ``scheme``'s parts (Kimi K3's MXFP4 experts):
    its parts are copied as they are and described by ``scheme``'s config group.
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    source: str  # how the source stores it: 'bfloat16', 'float8_e4m3fn', 'int4'
    encoded: bool  # source is quantized (dequantized on the fly)
    scheme: Scheme | None
    reason: str
    src_bytes: int
    out_dtype: torch.dtype
    out_bytes: int
    as_stored: bool = False

    @property
    def kept(self) -> bool:
        return self.scheme is None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def label(self) -> str:
        if self.as_stored:
            return f"{self.scheme.name} (as stored)"
        return self.scheme.name if self.scheme else "kept"


def _template(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".{N}", name)


def _regex_of(template: str) -> str:
    return "re:^" + re.escape(template).replace(re.escape("{N}"), r"\d+") + "$"


@dataclass
class Plan:
    """The resolved table: every logical tensor of the source, in storage order.

    unstored: Linear modules the model has whose weight the source does not store (a
    tied lm_head); they stay in high precision and are listed in ``ignore``.
    """

    rows: list[Decision]
    arch: str
    warnings: list[str] = field(default_factory=list)
    unstored: tuple[str, ...] = ()

    @property
    def quantized(self) -> list[Decision]:
        return [r for r in self.rows if not r.kept]

    def schemes(self) -> dict[str, Scheme]:
        """Each distinct scheme by name; two schemes that describe alike (e.g. w4a16 with
        minmax and with searched scales) are told apart as ``name``, ``name#2``, ..."""
        out: dict[str, Scheme] = {}
        for s in self.distinct_schemes():
            name, n = s.describe(), 1
            key = name
            while key in out:
                n += 1
                key = f"{name}#{n}"
            out[key] = s
        return out

    def distinct_schemes(self) -> list[Scheme]:
        """The quantized rows' schemes in first-use order: config group ``group_<i>`` of
        :meth:`quantization_config` is the i-th."""
        distinct: list[Scheme] = []
        for r in self.quantized:
            if r.scheme not in distinct:
                distinct.append(r.scheme)
        return distinct

    def totals(self) -> tuple[int, int]:
        return sum(r.src_bytes for r in self.rows), sum(r.out_bytes for r in self.rows)

    # -- compressed-tensors config ------------------------------------------------------
    def quantization_config(self) -> dict:
        """quantization_config for config.json (compressed-tensors layout).

        One config group per distinct scheme. With a single group the targets are the
        class ``Linear`` and everything kept is in ``ignore`` (the layout of released
        checkpoints); with several, each group's targets are disjoint name regexes
        (layer / expert indices generalised) or exact names where a template mixes
        schemes. Kept modules are always listed in ``ignore``, which every loader checks
        before targets - stored or not: a tied lm_head has no tensor of its own but is a
        Linear module every loader builds (and would quantize under ``Linear``).
        """
        linear_rows = [r for r in self.rows if r.name.endswith(".weight")]
        by_tpl: dict[str, list[Decision]] = {}
        for r in linear_rows:
            by_tpl.setdefault(_template(r.module), []).append(r)
        distinct = self.distinct_schemes()
        targets: dict[int, list[str]] = {i: [] for i in range(len(distinct))}
        ignore: list[str] = []
        for tpl, rows in by_tpl.items():
            kept = [r for r in rows if r.kept]
            quant = [r for r in rows if not r.kept]
            if kept:
                if not quant:
                    ignore.append(_regex_of(tpl) if "{N}" in tpl else tpl)
                else:
                    ignore.extend(r.module for r in kept)
            if quant:
                idx = {distinct.index(r.scheme) for r in quant}
                if len(idx) == 1:
                    (i,) = idx
                    targets[i].append(_regex_of(tpl) if "{N}" in tpl else tpl)
                else:
                    for r in quant:
                        targets[distinct.index(r.scheme)].append(r.module)
        stored = {r.module for r in linear_rows}
        ignore.extend(m for m in self.unstored if m not in stored and m not in ignore)
        groups = {}
        for i, s in enumerate(distinct):
            t = ["Linear"] if len(distinct) == 1 else targets[i]
            groups[f"group_{i}"] = s.ct_scheme(t)
        formats = {s.format for s in distinct}
        return {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": ignore,
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        }

    # -- display --------------------------------------------------------------------------
    def table(self, collapse: bool = True) -> str:
        """The resolved table. collapse: one line per name template (layers / experts)."""
        lines = []
        if collapse:
            agg: dict[tuple, list] = {}
            for r in self.rows:
                key = (_template(r.name), r.label, r.reason, r.source, r.shape)
                a = agg.setdefault(key, [0, 0, 0])
                a[0] += 1
                a[1] += r.src_bytes
                a[2] += r.out_bytes
            items = [(k[0], k[4], k[3], k[1], k[2], *v) for k, v in agg.items()]
        else:
            items = [
                (r.name, r.shape, r.source, r.label, r.reason, 1, r.src_bytes, r.out_bytes)
                for r in self.rows
            ]
        w = max([len(i[0]) for i in items] + [6])
        head = (
            f"{'tensor':<{w}}  {'n':>5}  {'shape':<14} {'source':<14} {'scheme':<16} "
            f"{'before':>10} {'after':>10}  reason"
        )
        lines.append(head)
        lines.append("-" * len(head))
        for name, shape, src, label, reason, n, b, a in items:
            shp = "x".join(map(str, shape))
            lines.append(
                f"{name:<{w}}  {n:>5}  {shp:<14} {src:<14} {label:<16} {_fmt(b):>10} "
                f"{_fmt(a):>10}  {reason}"
            )
        before, after = self.totals()
        nq = len(self.quantized)
        lines.append("-" * len(head))
        ratio = after / before if before else 0.0
        lines.append(
            f"{len(self.rows)} tensors ({nq} quantized, {len(self.rows) - nq} kept): "
            f"{_fmt(before)} -> {_fmt(after)} ({ratio:.2f}x)"
        )
        if self.unstored:
            lines.append(f"kept, not stored (tied): {', '.join(self.unstored)} - listed in ignore")
        for wmsg in self.warnings:
            lines.append(f"warning: {wmsg}")
        return "\n".join(lines)


def _fmt(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def is_linear_weight(name: str, shape: tuple[int, ...], role: Role) -> bool:
    return (
        name.endswith(".weight")
        and len(shape) == 2
        and role.component not in ("embeddings", "norms")
        and role.kind not in NON_LINEAR_KINDS
    )


def known_role_names(roles: Iterable[Role]) -> set[str]:
    out = set(COMPONENTS) | set(ROLE_ALIASES) | {"vision", "kda"}
    for r in roles:
        out.add(r.kind)
    return out


def validate_rule_roles(rules: Sequence[Rule], roles: Iterable[Role]) -> None:
    check_role_names(rules, known_role_names(roles))


def check_role_names(rules: Sequence[Rule], known: set[str]) -> None:
    """Every role a rule names is in ``known`` (ConfigError naming the rule, with the
    closest name)."""
    for rule in rules:
        for name in rule.roles:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                err = ConfigError(
                    f"{rule.where or 'rule'}: unknown role '{name}'.{hint} Roles: "
                    f"{', '.join(sorted(set(COMPONENTS) | set(ROLE_ALIASES)))}, or a tensor "
                    f"kind of this architecture (e.g. q_proj, down_proj)."
                )
                err.where = rule.where or None
                raise err


@dataclass(frozen=True)
class TensorInfo:
    """What the planner needs about a source tensor (no data)."""

    name: str
    shape: tuple[int, ...]
    role: Role
    source: str
    encoded: bool
    src_bytes: int
    dtype: torch.dtype  # dtype a kept tensor is written in


def resolve(
    tensors: Sequence[TensorInfo],
    *,
    arch: str,
    rules: Sequence[Rule] = (),
    default: Scheme | None = None,
    keep: Sequence[str] = (),
    default_keep: bool = True,
    unstored: Sequence[str] = (),
) -> Plan:
    """Decide every tensor (see module doc); scheme checks (group sizes) run here.

    unstored: Linear modules the model has but the source does not store (see Plan)."""
    for p in keep:
        check_pattern(p, "--keep")
    validate_rule_roles(rules, (t.role for t in tensors))
    resolved = [(rule, rule.resolve()) for rule in rules]
    rows: list[Decision] = []
    bad: list[GroupSizeError] = []
    used_keep: set[str] = set()
    for t in tensors:
        scheme, reason = None, ""
        module = t.name.removesuffix(".weight")
        hit = next((p for p in keep if pattern_matches(p, t.name, module)), None)
        if hit is not None:
            used_keep.add(hit)
            reason = f"--keep {hit}"
        elif default_keep and t.role.keep:
            reason = f"default exception ({t.role.component}: {t.role.kind})"
        elif not is_linear_weight(t.name, t.shape, t.role):
            reason = "not a Linear weight"
        else:
            for rule, s in resolved:
                if rule.applies(t.name, t.role):
                    scheme, reason = s, rule.label()
                    break
            else:
                if default is not None:
                    scheme, reason = default, "--scheme"
                else:
                    reason = "no rule matches"
        if scheme is not None:
            try:
                scheme.check(t.name, t.shape)
            except GroupSizeError as e:
                bad.append(e)
                continue
            out_bytes = scheme.nbytes(t.shape)
        else:
            out_bytes = math.prod(t.shape) * torch.empty((), dtype=t.dtype).element_size()
        rows.append(
            Decision(
                t.name, t.shape, t.role, t.source, t.encoded, scheme, reason,
                t.src_bytes, t.dtype, out_bytes,
            )
        )  # fmt: skip
    if bad:
        more = ""
        if len(bad) > 1:
            names = [e.tensor or "?" for e in bad[1:4]]
            more = (
                f" {len(bad) - 1} more tensor(s) have the same problem: {', '.join(names)}"
                + (", ..." if len(bad) > 4 else "")
                + "."
            )
        raise GroupSizeError(f"{bad[0]}{more}", bad[0].tensor)
    warnings = [f"--keep {p} matches no tensor" for p in keep if p not in used_keep]
    return Plan(rows, arch, warnings, tuple(unstored))
