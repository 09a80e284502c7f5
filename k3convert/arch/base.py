"""Architecture tables: tensor-name patterns -> Role, plus the shapes they must have.

An architecture is data: a config dataclass read from config.json and a list of
:class:`TensorSpec` rows. Each row is a name template (``{L}`` layer, ``{E}`` expert,
``{B}`` vision block), the shape it has under a config, and its :class:`Role` (what it
is, where it runs, how tensor parallelism splits it, whether it is kept in high
precision). The same table classifies a checkpoint's names, counts parameters from a
config alone (``inspect`` on a 3 T config.json), and generates the tensors ``synth``
writes, so these three can never disagree.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ..errors import ArchError, CheckpointError, ConfigError, UnknownTensorsError, short_repr

#: components inspect reports, in display order
COMPONENTS = (
    "embeddings",
    "vision",
    "projector",
    "attention",
    "linear_attention",
    "attn_res",
    "norms",
    "dense_mlp",
    "router",
    "shared_experts",
    "latent",
    "routed_experts",
    "head",
    "mtp",
)

#: how tensor parallelism treats a tensor (see DESIGN.md, split rules)
SPLITS = {
    "replicate": None,  # every rank holds the whole tensor
    "vocab": 0,  # rows by vocabulary, padded to a multiple of tp
    "heads": 0,  # rows by attention heads (q, q_b, kv_b)
    "kv_heads": 0,  # rows by KV heads, replicated when tp > kv heads
    "col": 0,  # rows (column-parallel linear: gate / up)
    "row": 1,  # columns (row-parallel linear: o_proj / down)
    "kda_heads": 0,  # rows by linear-attention (KDA) heads: q/k/v/g, conv, b, f_b, dt_bias
    "kda_row": 1,  # columns by KDA heads (KDA o_proj)
    "kda_a_log": 0,  # KDA A_log: narrowed to its heads, then one per head (the dim holding them)
}

#: scopes: how many instances a row has
SCOPES = (
    "global",
    "layer",
    "dense_layer",
    "moe_layer",
    "kda_layer",  # linear-attention (KDA) layers of a hybrid model (cfg.is_kda_layer)
    "mla_layer",  # the full-attention layers of a hybrid model
    "expert",
    "vision_block",
    "mtp",
)


@dataclass(frozen=True)
class Role:
    """What one tensor is.

    component: one of COMPONENTS; kind: the tensor's function ('q_proj', 'router', ...);
    layer: decoder layer index (MTP layers continue after the last one);
    expert: routed expert index; block: vision encoder block index;
    split: key of SPLITS; keep: True for sensitive tensors kept in high precision.
    """

    component: str
    kind: str
    split: str = "replicate"
    keep: bool = False
    layer: int | None = None
    expert: int | None = None
    block: int | None = None
    mtp: bool = False

    @property
    def split_dim(self) -> int | None:
        return SPLITS[self.split]

    @property
    def unit(self) -> str:
        """Execution unit: 'embed', 'vision', 'layer.N', 'head' (MTP: 'mtp.N')."""
        if self.mtp:
            return f"mtp.{self.layer}"
        if self.layer is not None:
            return f"layer.{self.layer}"
        if self.component in ("vision", "projector"):
            return "vision"
        if self.component == "embeddings":
            return "embed"
        return "head"


ShapeFn = Callable[[Any], tuple[int, ...]]


@dataclass(frozen=True)
class TensorSpec:
    """One row of an architecture table.

    pattern: canonical name template (what synth writes); aliases: other spellings seen
    in released checkpoints; when: predicate on the config (row exists or not);
    stored: the shape a release stores when it pads the tensor beyond its logical
    ``shape`` (Kimi K3's A_log: [128] for 96 heads); both shapes are accepted, synth
    writes the stored one, and only the logical prefix is used. optional: a tensor the
    table accepts but a config does not imply (the calibrated KV-cache scales, present
    only with a ``kv_cache_scheme``): :meth:`Arch.instances` leaves it out unless asked,
    so synth never writes it and completeness never asks for it.
    """

    pattern: str
    scope: str
    component: str
    kind: str
    shape: ShapeFn
    split: str = "replicate"
    keep: bool = False
    when: Callable[[Any], bool] = lambda c: True
    aliases: tuple[str, ...] = ()
    stored: ShapeFn | None = None
    optional: bool = False

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"bad scope {self.scope}")
        if self.split not in SPLITS:
            raise ValueError(f"bad split {self.split}")
        if self.component not in COMPONENTS:
            raise ValueError(f"bad component {self.component}")


def _template_regex(t: str) -> re.Pattern:
    rx = re.escape(t)
    for key in ("L", "E", "B"):
        rx = rx.replace(re.escape("{" + key + "}"), f"(?P<{key}>\\d+)")
    return re.compile(rx + r"\Z")


@dataclass(frozen=True)
class Instance:
    """One concrete tensor an architecture expects under a config (``stored``: the padded
    shape a release writes, see :class:`TensorSpec`)."""

    name: str
    shape: tuple[int, ...]
    role: Role
    stored: tuple[int, ...] | None = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.stored or self.shape


@dataclass
class Arch:
    """A model family: its config parser, its tensor table and what the runtime and the
    KV-cache code ask of it (attention and router kinds, where the decoder's config is)."""

    name: str
    aliases: tuple[str, ...]
    parse_config: Callable[[dict], Any]
    specs: Callable[[Any], list[TensorSpec]]
    doc: str = ""
    #: the attention of the layers that cache K / V: ``gqa`` or ``mla``
    attention: str = "gqa"
    #: the MoE router: ``softmax``, ``sigmoid_group``, or None for a dense model
    router: str | None = None
    #: KDA linear-attention layers mixed with ``attention`` ones (``cfg.is_kda_layer``)
    hybrid: bool = False
    #: a multimodal release: the decoder's config.json section (``text_config``)
    text_key: str | None = None
    #: its vision tower: ``moonvit`` (Kimi-K2.5) or ``moonvit3d`` (Kimi K3, which widens
    #: each image's placeholder to the image's merged patches); None: text only
    vision: str | None = None
    #: where decoder layer ``{L}``'s attention module lives (its KV-cache scales'
    #: names: ``k_scale`` / ``v_scale`` appended)
    attention_prefix: str = "model.layers.{L}.self_attn."
    #: whose modeling code the runtime's forward pass reproduces, where two differ:
    #: ``transformers`` or ``moonshot`` (the modeling_kimi_linear shipped with Kimi K3: SiTU
    #: MLPs, sigmoid routing only, MLA without rotary, top-k renormalised only when k > 1)
    reference: str = "transformers"

    def config(self, raw: dict) -> Any:
        return self.parse_config(raw)

    def text_raw(self, raw: dict) -> dict:
        """The decoder's part of a config.json dict."""
        return raw.get(self.text_key) if self.text_key else raw

    def attention_of(self, cfg: Any, layer: int) -> str:
        """Attention kind of decoder layer ``layer``: gqa, mla or kda."""
        text = getattr(cfg, "text", cfg)
        return "kda" if self.hybrid and text.is_kda_layer(layer) else self.attention

    def table(self, cfg: Any) -> list[TensorSpec]:
        return [s for s in self.specs(cfg) if s.when(cfg)]

    def instances(
        self, cfg: Any, *, mtp: bool = True, optional: bool = False
    ) -> Iterator[Instance]:
        """Every tensor this config implies, in execution order (optional rows only when
        ``optional``)."""
        for spec in self.table(cfg):
            if spec.optional and not optional:
                continue
            for idx in scope_indices(spec.scope, cfg, mtp):
                name = spec.pattern.format(**idx)
                yield Instance(
                    name,
                    tuple(spec.shape(cfg)),
                    role_of(spec, idx, cfg),
                    stored_shape_of(spec, cfg),
                )

    def match(self, cfg: Any, names: Iterable[str], where: str = "") -> dict[str, Match]:
        """Role, canonical spelling and expected shape of every name, in one pass.

        UnknownTensorsError lists the names that match no row.
        """
        index = _indexed(self.specs, cfg)
        out: dict[str, Match] = {}
        unknown: list[str] = []
        for n in names:
            for spec, rx in index.get(_DIGITS.sub("#", n), ()):
                m = rx.match(n)
                if m:
                    idx = {k: int(v) for k, v in m.groupdict().items()}
                    if _in_range(spec.scope, idx, cfg):
                        out[n] = Match(
                            role_of(spec, idx, cfg),
                            spec.pattern.format(**idx),
                            tuple(spec.shape(cfg)),
                            stored_shape_of(spec, cfg),
                        )
                        break
            else:
                unknown.append(n)
        if unknown:
            raise UnknownTensorsError(self.name, unknown, where)
        return out

    def validate(
        self,
        cfg: Any,
        names: Iterable[str],
        where: str,
        *,
        shape_of: Callable[[str], tuple[int, ...]] | None = None,
        file_of: Callable[[str], Any] | None = None,
        complete: bool = True,
    ) -> dict[str, Match]:
        """:meth:`match`, plus the checks every verb runs before it uses a weight source.

        ``shape_of(name)``: the tensor's logical (dequantized) shape, which must be the
        one config.json implies. ``complete``: every tensor the config implies must be
        present (MTP layers only when the source has any; a tied lm_head is not a
        tensor). ``file_of(name)`` locates a bad tensor in the message.
        """
        names = list(names)
        matched = self.match(cfg, names, where)
        if shape_of is not None:
            bad = [
                n for n in names if tuple(shape_of(n)) not in (matched[n].shape, matched[n].stored)
            ]
            if bad:
                n = bad[0]
                loc = file_of(n) if file_of is not None else where
                padded = matched[n].stored
                also = f" (or {list(padded)} as released, padded)" if padded else ""
                raise ArchError(
                    f"{loc}: tensor '{n}' has shape {list(shape_of(n))} but config.json "
                    f"implies {list(matched[n].shape)}{also} ({len(bad)} tensor(s) disagree); "
                    f"the weights do not match the config."
                )
        if complete:
            present = {m.canonical for m in matched.values()}
            mtp = any(m.role.mtp for m in matched.values())
            missing = [i.name for i in self.instances(cfg, mtp=mtp) if i.name not in present]
            if missing:
                more = f" (and {len(missing) - 6} more)" if len(missing) > 6 else ""
                raise CheckpointError(
                    f"{where}: lacks {len(missing)} tensor(s) that config.json implies: "
                    f"{', '.join(missing[:6])}{more}; the download or conversion is "
                    f"incomplete, or config.json describes another model."
                )
        return matched

    def classify(self, cfg: Any, names: Iterable[str], where: str = "") -> dict[str, Role]:
        """Role of every name (see :meth:`match`)."""
        return {n: m.role for n, m in self.match(cfg, names, where).items()}

    def canonical(self, cfg: Any, names: Iterable[str], where: str = "") -> dict[str, str]:
        """name -> the spelling synth writes (aliases resolved)."""
        return {n: m.canonical for n, m in self.match(cfg, names, where).items()}

    def expected_shapes(self, cfg: Any, names: Iterable[str], where: str = ""):
        """name -> the shape the table says it must have under ``cfg``."""
        return {n: m.shape for n, m in self.match(cfg, names, where).items()}


def stored_shape_of(spec: TensorSpec, cfg: Any) -> tuple[int, ...] | None:
    shape = spec.stored(cfg) if spec.stored is not None else None
    return tuple(shape) if shape is not None else None


class Match(NamedTuple):
    role: Role
    canonical: str
    shape: tuple[int, ...]
    stored: tuple[int, ...] | None = None  # a release's padded shape (TensorSpec.stored)


_DIGITS = re.compile(r"\d+")


@functools.lru_cache(maxsize=16)
def _indexed(specs: Callable[[Any], list[TensorSpec]], cfg: Any):
    """(row, regex) for every spelling of every row that exists under ``cfg``, in table
    order, by the spelling's shape (each run of digits as ``#``). A name a spelling
    matches has that spelling's shape (a field is a run of digits, merged with any digit
    beside it either way), so a name tries only the spellings of its own shape."""
    index: dict[str, list] = {}
    rows = [s for s in specs(cfg) if s.when(cfg)]
    for spec, p in ((r, p) for r in rows for p in (r.pattern, *r.aliases)):
        key = _DIGITS.sub("#", p.replace("{L}", "0").replace("{E}", "0").replace("{B}", "0"))
        index.setdefault(key, []).append((spec, _template_regex(p)))
    return index


def _layer_kinds(cfg) -> list[str]:
    return ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_layers)]


def scope_indices(scope: str, cfg, mtp: bool) -> Iterator[dict[str, int]]:
    if scope == "global":
        yield {}
    elif scope in ("kda_layer", "mla_layer"):
        for i in range(cfg.num_layers):
            if cfg.is_kda_layer(i) == (scope == "kda_layer"):
                yield {"L": i}
    elif scope in ("layer", "dense_layer", "moe_layer"):
        for i, k in enumerate(_layer_kinds(cfg)):
            if scope == "layer" or scope == f"{k}_layer":
                yield {"L": i}
        if mtp and scope != "dense_layer":  # MTP layers are full MoE layers
            for i in range(cfg.num_layers, cfg.num_layers + getattr(cfg, "num_mtp", 0)):
                yield {"L": i}
    elif scope == "expert":
        layers = [i for i, k in enumerate(_layer_kinds(cfg)) if k == "moe"]
        if mtp:
            layers += range(cfg.num_layers, cfg.num_layers + getattr(cfg, "num_mtp", 0))
        for i in layers:
            for e in range(cfg.num_experts):
                yield {"L": i, "E": e}
    elif scope == "vision_block":
        for b in range(cfg.vision.num_layers):
            yield {"B": b}
    elif scope == "mtp" and mtp:
        for i in range(cfg.num_layers, cfg.num_layers + getattr(cfg, "num_mtp", 0)):
            yield {"L": i}


def _in_range(scope: str, idx: dict[str, int], cfg) -> bool:
    n, n_mtp = cfg.num_layers, getattr(cfg, "num_mtp", 0)
    layer = idx.get("L")
    if scope == "vision_block":
        return idx["B"] < cfg.vision.num_layers
    if scope == "mtp":
        return n <= layer < n + n_mtp
    if layer is not None:
        if layer >= n + n_mtp:
            return False
        if scope in ("kda_layer", "mla_layer"):
            return layer < n and cfg.is_kda_layer(layer) == (scope == "kda_layer")
        if layer >= n:  # MTP layer: any MoE-layer row applies
            if scope == "dense_layer":
                return False
        elif (scope == "dense_layer" and cfg.is_moe_layer(layer)) or (
            scope in ("moe_layer", "expert") and not cfg.is_moe_layer(layer)
        ):
            return False
    return not ("E" in idx and idx["E"] >= cfg.num_experts)


def role_of(spec: TensorSpec, idx: dict[str, int], cfg) -> Role:
    layer = idx.get("L")
    is_mtp = layer is not None and layer >= cfg.num_layers
    r = Role(
        component=spec.component,
        kind=spec.kind,
        split=spec.split,
        keep=spec.keep,
        layer=layer,
        expert=idx.get("E"),
        block=idx.get("B"),
        mtp=is_mtp,
    )
    if is_mtp:  # MTP layers are kept in high precision and reported on their own
        r = replace(r, component="mtp", keep=True)
    return r


# -- registry -----------------------------------------------------------------------
_REGISTRY: dict[str, Arch] = {}
_ALIASES: dict[str, str] = {}


def register(arch: Arch) -> Arch:
    _REGISTRY[arch.name] = arch
    for a in arch.aliases:
        _ALIASES[a] = arch.name
    return arch


def known_model_types() -> list[str]:
    return sorted([*_REGISTRY, *_ALIASES])


def get_arch(model_type: str) -> Arch:
    name = _ALIASES.get(model_type, model_type)
    if name not in _REGISTRY:
        raise ArchError(
            f"unknown model_type '{model_type}' in config.json; k3convert knows: "
            f"{', '.join(known_model_types())}."
        )
    return _REGISTRY[name]


def arch_for_config(raw: dict, where: str = "config.json") -> Arch:
    mt = raw.get("model_type")
    if not isinstance(mt, str):
        raise ConfigError(f"{where}: no 'model_type' key; is this a Hugging Face config?")
    return get_arch(mt)


# -- config helpers -----------------------------------------------------------------
class TextFields:
    """Mixin of a multimodal config (``text`` + ``vision``): the decoder's fields and
    methods read through, so table rows and verbs use one config object."""

    def __getattr__(self, name):
        if name in ("text", "vision") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.text, name)


def check_routing(
    experts: int,
    topk: int,
    n_group: int,
    topk_group: int,
    where: str,
    keys: tuple[str, str, str] = ("n_routed_experts", "num_experts_per_tok", "n_group"),
) -> None:
    """Top-k routing a config can run: k <= experts, groups that divide the experts and
    top groups <= groups (``keys``: the config's names for the three counts)."""
    ke, kk, kg = keys
    if not experts:
        return
    if topk > experts:
        raise ConfigError(f"{where}: {kk}={topk} exceeds {ke}={experts}.")
    if experts % n_group:
        raise ConfigError(f"{where}: {ke}={experts} is not divisible by {kg}={n_group}.")
    if topk_group > n_group:
        raise ConfigError(f"{where}: topk_group={topk_group} exceeds {kg}={n_group}.")


def req(raw: dict, key: str, where: str, *alts: str) -> Any:
    for k in (key, *alts):
        if raw.get(k) is not None:
            return raw[k]
    raise ConfigError(f"{where}: missing required key '{key}'.")


#: largest value a config integer may take; a key not listed here gets DEFAULT_LIMIT.
#: Generous (several times today's largest releases) but finite, so that an absurd
#: config is refused instead of enumerating a billion layers.
LIMITS = {
    "num_hidden_layers": 4096,
    "num_nextn_predict_layers": 64,
    "num_attention_heads": 16384,
    "num_key_value_heads": 16384,
    "n_routed_experts": 65536,
    "num_experts": 65536,
    "num_local_experts": 65536,
    "num_experts_per_tok": 65536,
    "n_shared_experts": 1024,
    "n_group": 65536,
    "topk_group": 65536,
    "first_k_dense_replace": 4096,
    "moe_layer_freq": 4096,
}
DEFAULT_LIMIT = 1 << 24  # widths, vocabularies, ranks, patch and position-table sizes


def positive(value: Any, key: str, where: str, *, limit: int | None = None) -> int:
    """A config integer in [1, limit] (LIMITS[key] or DEFAULT_LIMIT by default)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: '{key}' must be a positive integer, got {short_repr(value)}.")
    top = limit if limit is not None else LIMITS.get(key, DEFAULT_LIMIT)
    if value > top:
        raise ConfigError(
            f"{where}: '{key}' = {value} is beyond any real model (at most {top}); the config "
            f"is damaged or not a model config."
        )
    return value


def count(value: Any, key: str, where: str) -> int:
    """A config integer that may be 0 (absent or null: 0), bounded like :func:`positive`."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return 0
    return positive(value, key, where)


def finite(value: Any, key: str, where: str, default: float, *, zero: bool = False) -> float:
    """A positive (``zero``: or zero) finite config float (``default`` when absent/null)."""
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: '{key}' must be a number, got {short_repr(value)}.")
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float
        v = math.inf
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        kind = "non-negative" if zero else "positive"
        raise ConfigError(
            f"{where}: '{key}' must be a {kind} finite number, got {short_repr(value)}."
        )
    return v
