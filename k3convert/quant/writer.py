"""``quantize``: stream a checkpoint tensor by tensor into a compressed-tensors directory.

Nothing holds the model: each tensor is mapped from the source, dequantized if the
source is encoded (an FP8-block release re-quantizes to int4 experts without a bf16
copy), quantized, written at its place in the output file, and dropped; at most
``workers`` tensors are in flight, each worker on one core. Tensors kept as they are
stored are copied by the kernel (``copy_file_range``) after a chunked NaN / Inf check.
Everything that can be checked is checked before the first byte (scheme names, group
divisibility, static activation scales, OUT, free disk); a NaN / Inf found while
streaming aborts the run and removes the partial output. The output is written to a
hidden ``.OUT.partial-PID`` directory and renamed at the end, so OUT either does not
exist or is complete.

Output layout (Hugging Face + compressed-tensors): ``config.json`` with
``quantization_config`` (quant_method compressed-tensors, format, config_groups,
ignore) and a ``k3convert`` provenance block; ``model-0000i-of-0000n.safetensors``
shards of at most ``shard_size`` bytes with ``model.safetensors.index.json``; the
source's tokenizer / processor files copied. Kept tensors are copied bit for bit. A kept
tensor of an encoded source stays as stored when a registered weight-only scheme stores
exactly those parts (Kimi K3's MXFP4 experts, a W4A16 release's int4 groups): its parts
are copied unchanged and that scheme's config group describes them; otherwise (DeepSeek's
FP8 blocks, which compressed-tensors names differently) it is written dequantized in the
config dtype.

Part names come from the schemes (and through them the format registry,
:mod:`k3convert.formats`): the weight's parts, then the activation parameters stored
with it (a static spec's ``input_scale``, NVFP4's ``input_global_scale``). NVFP4
Linears that run fused at inference (q/k/v, gate/up, w1/w3, q_a/kv_a of a module)
share one global scale from the largest |value| of the set, as llm-compressor fuses
them and vLLM requires: a first pass maps each of those tensors once more to take its
maximum (one tensor at a time), before anything is written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .. import __version__ as _k3_version
from .. import formats as fmt
from ..arch import resolve as resolve_arch
from ..arch import validate_source
from ..checkpoint import open_checkpoint
from ..checkpoint.output import (
    check_output,
    group_by_size,
    guard_out,
    shard_names,
    staged_output,
    write_error,
    write_index,
)
from ..checkpoint.safetensors_io import SafetensorsWriter, map_chunks
from ..errors import ConfigError, OutputError, short_repr
from ..formats import ACTIVATION_PARTS
from . import fidelity, fp4_requant
from .rules import Decision, Plan, Rule, TensorInfo, make_rule, resolve
from .schemes import IntScheme, NonFiniteWeightError, get_scheme, known_schemes

DEFAULT_SHARD_SIZE = 4 << 30
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class QuantizeResult:
    """What ``quantize`` did (or would do, for a dry run)."""

    out: Path | None
    plan: Plan
    dry_run: bool
    seconds: float = 0.0
    files: int = 0
    #: layer-sequential calibration's result (:class:`k3convert.calibrate.sequential.
    #: SequentialResult`) when ``calibrate`` was given, else None
    calibration: object | None = None
    #: ``OUT/routing_counts.json`` when calibration saw MoE layers (``shard --expert-load``)
    routing_counts: Path | None = None
    #: ``auto_keep``: the sensitivity report and the selection applied to the plan
    sensitivity: object | None = None
    selection: object | None = None
    #: what re-encoding the release did to its values (:class:`.fidelity.LossReport`)
    fidelity: fidelity.LossReport | None = None

    def table(self, collapse: bool = True) -> str:
        return self.plan.table(collapse)

    def summary(self) -> str:
        before, after = self.plan.totals()
        n = len(self.plan.quantized)
        what = "would write" if self.dry_run else f"wrote {self.out}:"
        from ..inspect import human_bytes

        rate = f", {before / self.seconds / 1e9:.2f} GB/s" if self.seconds > 0 else ""
        return (
            f"{what} {n} of {len(self.plan.rows)} tensors quantized "
            f"({', '.join(sorted(self.plan.schemes())) or 'none'}), "
            f"{human_bytes(before)} -> {human_bytes(after)}"
            + (f" in {self.files} file(s), {self.seconds:.1f} s{rate}" if not self.dry_run else "")
            + (
                f"\nrelease fidelity: {self.fidelity.summary()}; details in {fidelity.FILE}"
                if self.fidelity
                else ""
            )
        )


def _config_dtype(config: dict) -> torch.dtype:
    t = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    name = str(t.get("dtype") or t.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return _DTYPE_NAMES.get(name, torch.bfloat16)


def _infos(ckpt, roles) -> list[TensorInfo]:
    dtype = _config_dtype(ckpt.config)
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


def _recipe_rules(recipe) -> tuple[list[Rule], str | None, list[str], bool | None]:
    from ..recipe import load_recipe

    r = load_recipe(recipe) if isinstance(recipe, (str, os.PathLike)) else recipe
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
    """(checkpoint, plan): open the source and resolve every tensor; reads no data.
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
        rules, default_name, rkeep, rdefault_keep = _recipe_rules(recipe)
        default = get_scheme(default_name) if default_name else None
        keep = rkeep + keep
        if rdefault_keep is False:
            default_keep = False
    else:
        default = get_scheme(scheme)
    ckpt = open_checkpoint(src)
    arch, cfg = resolve_arch(ckpt.config, f"{ckpt.root}/config.json")
    matched = validate_source(arch, cfg, ckpt, str(ckpt.root))
    roles = {n: m.role for n, m in matched.items()}
    plan = resolve(
        _infos(ckpt, roles),
        arch=arch.name,
        rules=rules,
        default=default,
        keep=keep,
        default_keep=default_keep,
        unstored=_tied_linears(arch, cfg),
    )
    if kept_as_stored:
        plan.rows = [_keep_as_stored(ckpt, r) for r in plan.rows]
    if weight_observer is not None:
        plan.rows = _with_observer(plan, weight_observer)
    else:
        plan.rows = _mx_search(ckpt, plan)
    return ckpt, plan


def _mx_search(ckpt, plan: Plan) -> list:
    """The plan's rows, every MXFP4 source under a minmax int4 scheme that
    :mod:`.mx_int4` produces switched to its per-group scale search (the default for an
    MXFP4 release: its minmax scales move values the search keeps)."""
    from . import mx_int4

    rows = []
    for r in plan.rows:
        s = r.scheme
        if (not r.kept and not r.as_stored and isinstance(s, IntScheme) and s.observer == "minmax"
                and mx_int4.applies(s) and ckpt.meta(r.name).encoding == fmt.MXFP4):  # fmt: skip
            r = dataclasses.replace(r, scheme=dataclasses.replace(s, observer="search"))
        rows.append(r)
    return rows


def _with_observer(plan: Plan, observer: str) -> list:
    """The plan's rows with every integer scheme's weight observer set to ``observer``."""
    if observer not in ("minmax", "mse"):
        raise ConfigError(f"weight observer must be minmax or mse, not {short_repr(observer)}.")
    ints = [r for r in plan.quantized if isinstance(r.scheme, IntScheme) and not r.as_stored]
    if not ints:
        used = sorted({r.scheme.name for r in plan.quantized}) or ["none: every tensor is kept"]
        raise ConfigError(
            f"the weight observer ({observer}) chooses integer scales; no tensor of this plan "
            f"is quantized to an integer scheme (schemes: {', '.join(used)}). Use an int "
            f"scheme (w4a16, w4a16-asym, w8a8, int4-g128, ...) or drop --weight-observer."
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


def _keep_as_stored(ckpt, r: Decision) -> Decision:
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


def _tied_linears(arch, cfg) -> list[str]:
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


def _entries(r: Decision) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if r.kept:
        return [(r.name, r.out_dtype, r.shape)]
    base = r.module
    e = [(f"{base}.{k}", d, s) for k, d, s in r.scheme.parts(r.shape)]
    e += [(f"{base}.{k}", d, s) for k, d, s in r.scheme.act_parts()]
    return e


#: sibling Linears that serving engines run as one fused matmul (llm-compressor's
#: FUSED_LAYER_NAMES): under NVFP4 they must share a global scale
FUSED_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


def fused_groups(plan: Plan) -> list[list[Decision]]:
    """Sets of rows (>= 2) that share one NVFP4 global scale: siblings of one parent
    module in a :data:`FUSED_SETS` entry, every one of them stored under a scheme with a
    shared global scale (as llm-compressor fuses only sets that are all tensor_group)."""
    by_parent: dict[tuple[str, int], list[Decision]] = {}
    rows = {r.module: r for r in plan.rows if r.name.endswith(".weight")}
    for module, r in rows.items():
        parent, _, leaf = module.rpartition(".")
        for i, names in enumerate(FUSED_SETS):
            if leaf in names:
                by_parent.setdefault((parent, i), []).append(r)
    out = []
    for members in by_parent.values():
        shared = all(not r.kept and not r.as_stored  # as stored: its global scale is kept
                     and getattr(r.scheme, "shares_global_scale", False)
                     for r in members)  # fmt: skip
        if len(members) >= 2 and shared:
            out.append(members)
    return out


@dataclass(frozen=True)
class SharedScale:
    """What the members of a fused set (see :func:`fused_groups`) share: the largest
    |value| of the set (the global scale of a quantized NVFP4), and, where every member is
    MXFP4, the largest E8M0 code of their nonzero groups (the global scale of the exact
    MXFP4 -> NVFP4 transcode, :func:`fp4_requant.nvfp4_exact`)."""

    amax: torch.Tensor
    top_code: int | None


def _shared_amax(ckpt, plan: Plan, workers: int) -> dict[str, SharedScale]:
    """Tensor name -> what its fused set shares (see :class:`SharedScale`), one source
    tensor mapped (or dequantized) at a time per worker."""
    groups = fused_groups(plan)
    if not groups:
        return {}

    def one(r: Decision) -> tuple[str, tuple[torch.Tensor, int | None, bool]]:
        mx = ckpt.meta(r.name).encoding == fmt.MXFP4
        if mx and fp4_requant.supported(r.scheme):  # from the group maxima: no decode
            parts = ckpt.get_parts(r.name)
            top = fp4_requant.abs_max(parts)
            if top is not None:
                return r.name, (top, fp4_requant.top_code(parts), True)
        w = ckpt.get(r.name)
        try:
            return r.name, (r.scheme.abs_max(w, name=r.name), None, False)
        except NonFiniteWeightError as e:
            raise NonFiniteWeightError(f"{ckpt.root}: {e}") from None

    rows = [r for g in groups for r in g]
    got = dict(_unordered(one, rows, workers))
    out: dict[str, SharedScale] = {}
    for g in groups:
        top = torch.stack([got[r.name][0] for r in g]).amax()
        codes = [got[r.name][1] for r in g if got[r.name][1] is not None]
        all_mx = all(got[r.name][2] for r in g)
        share = SharedScale(top, max(codes) if all_mx and codes else None)
        out.update({r.name: share for r in g})
    return out


def _checked(dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` can be NaN / Inf worth refusing (fp8 has no Inf and
    its NaN comes from the source as stored; integers have neither)."""
    return dtype.is_floating_point and dtype.itemsize > 1


def _finite(t: torch.Tensor) -> bool:
    """One reduction that allocates nothing: min and max propagate NaN, and are finite
    exactly when every value is."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _non_finite(name: str, bad: int, where: Path) -> NonFiniteWeightError:
    return NonFiniteWeightError(
        f"{where}: tensor '{name}' holds {bad} NaN/Inf value(s); the source is "
        f"corrupt - fix or re-download it (nothing was written to the output)."
    )


def _check_finite(name: str, t: torch.Tensor, where: Path) -> None:
    """NaN / Inf in a tensor copied as it is (the count is taken only for the message).
    Quantized tensors are not checked here: every scheme takes the maximum of every
    group and refuses a non-finite one (:func:`_produce` names the file)."""
    if _checked(t.dtype) and not _finite(t):
        raise _non_finite(name, int((~torch.isfinite(t)).sum()), where)


def _check_finite_chunks(name: str, path: Path, info, where: Path) -> None:
    """:func:`_check_finite` over a stored tensor, one mapped chunk at a time."""
    if not _checked(info.dtype) or all(_finite(c) for c in map_chunks(path, info)):
        return
    bad = sum(int((~torch.isfinite(c)).sum()) for c in map_chunks(path, info))
    raise _non_finite(name, bad, where)


def _produce(
    ckpt,
    r: Decision,
    input_scales: Mapping,
    shared: Mapping | None = None,
    calibrated=None,
    losses: list | None = None,
) -> dict[str, torch.Tensor]:
    """The output tensors of one row, by output name. shared: tensor name -> the largest
    |value| of its fused set, for schemes whose fused Linears share a global scale.
    calibrated: a calibration result whose ``weight_parts(name)`` gives GPTQ's parts for
    the rows it calibrated (None: round to nearest). losses: where the row's
    :class:`.fidelity.TensorLoss` is appended when it re-encodes a released encoding."""
    if r.kept:
        if r.encoded:
            w = ckpt.get(r.name)
            _check_finite(r.name, w, ckpt.root)
            return {r.name: w.to(r.out_dtype)}
        t = ckpt.get_parts(r.name)["weight"]
        _check_finite(r.name, t, ckpt.root)
        return {r.name: t}
    parts = calibrated.weight_parts(r.name) if calibrated is not None else None
    stats: dict = {}
    if parts is None:
        share = shared.get(r.name) if shared else None
        kw = {} if share is None else {"global_amax": share.amax, "top_code": share.top_code}
        try:
            parts = quantize_stored(ckpt, r.name, r.scheme, stats=stats, **kw)
        except NonFiniteWeightError as e:  # the scheme names the tensor; add the checkpoint
            raise NonFiniteWeightError(f"{ckpt.root}: {e}") from None
    if losses is not None and re_encodes(r):
        losses.append(release_loss(ckpt, r, parts, exact=stats.get("exact", False)))
    out = {f"{r.module}.{k}": v for k, v in parts.items()}
    for k, v in r.scheme.act_values(input_scales.get(r.module)).items():
        out[f"{r.module}.{k}"] = v
    return out


def quantize_stored(
    ckpt, name: str, scheme, *, global_amax=None, top_code=None, stats: dict | None = None
) -> dict[str, torch.Tensor]:
    """``scheme.quantize`` of source tensor ``name`` dequantized to float32; an MXFP4
    source under a scheme :mod:`.fp4_requant` produces straight from its bytes takes
    that path (NVFP4: the exact transcode, its global scale from ``top_code``, the fused
    set's; FP8: power-of-two scales; int4: the searched or minmax scales, see there).
    stats: filled by :func:`.fp4_requant.requantize` (``exact``: known to hold every
    value)."""
    kw = {} if global_amax is None else {"global_amax": global_amax}
    if ckpt.meta(name).encoding == fmt.MXFP4 and fp4_requant.supported(scheme):
        got = fp4_requant.requantize(ckpt.get_parts(name), scheme, name=name, top_code=top_code,
                                     stats=stats)  # fmt: skip
        if got is not None:
            return got
    w = ckpt.get(name)
    return scheme.quantize(w, name=name, **kw)


def re_encodes(r: Decision) -> bool:
    """Whether row ``r`` changes a released encoding: a 2-D encoded source quantized under
    a scheme (not kept, not copied as stored) - the rows the loss report measures."""
    return r.encoded and not r.kept and not r.as_stored and len(r.shape) == 2


def release_loss(ckpt, r: Decision, parts: Mapping[str, torch.Tensor], *, exact: bool = False):
    """Row ``r``'s :class:`.fidelity.TensorLoss` against the release's decode (a row that
    :func:`re_encodes`; ``parts``: its weight parts under ``r.scheme``). exact: known to
    hold every value (no comparison is run)."""
    m = ckpt.meta(r.name)
    enc = fmt.ENCODINGS[m.encoding]
    scale = m.parts.get(enc.scale_part)
    try:
        group = fmt.scale_block(tuple(scale.shape), tuple(m.shape), m.quant.block)
    except (AttributeError, ValueError):
        group = (1, m.shape[1])
    if exact:
        return fidelity.exact(r.name, m.encoding, r.scheme.name, m.shape, group)
    return fidelity.measure(r.name, m.encoding, r.scheme.name, ckpt.get(r.name),
                            r.scheme.dequantize(parts), group)  # fmt: skip


def _check_scale(name: str, t: torch.Tensor, where: Path) -> None:
    """Last line of defence: no scale (weight_scale, input_scale) is written non-finite."""
    if not (name.endswith("_scale") and t.dtype.is_floating_point):
        return
    if t.dtype.itemsize == 1:  # e4m3 scales: isfinite has no fp8 kernel
        t = t.float()
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteWeightError(
            f"{where}: refusing to write '{name}': {bad} of its {t.numel()} value(s) are "
            f"NaN/Inf; a quantized weight with such a scale dequantizes to garbage. "
            f"Keep the tensor (--keep), or fix the calibration scales that gave it."
        )


def _output_config(
    config: dict, plan: Plan, src: Path, calibration: dict | None = None, kv_tensors=None
) -> dict:
    from ..arch import kv_cache_scheme_of
    from .kvcache import kv_cache_scheme

    src_kv = kv_cache_scheme_of(config)
    cfg = copy.deepcopy(config)
    cfg.pop("compression_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    if plan.quantized:
        cfg["quantization_config"] = plan.quantization_config()
        # KV-cache scales: calibrated now, or the source's (kept, copied) with its scheme
        kept_kv = any(r.name.endswith((".k_scale", ".v_scale")) for r in plan.rows)
        if kv_tensors:
            cfg["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme()
        elif kept_kv and src_kv:
            cfg["quantization_config"]["kv_cache_scheme"] = src_kv
    else:
        cfg.pop("quantization_config", None)
    cfg["k3convert"] = {
        "version": _k3_version,
        "source": str(Path(src).resolve()),
        "schemes": {
            name: {"options": s.options(), "format": s.format} for name, s in plan.schemes().items()
        },
    }
    if calibration is not None:
        cfg["k3convert"]["calibration"] = calibration
    return cfg


def _mark_actorder(cfg: dict, plan: Plan, calibrated, provenance: dict | None) -> None:
    """``actorder: static`` (compressed-tensors' alias of ``weight``) on the weights of
    every config group GPTQ solved with activation order: the columns were swept by
    descending ``diag(H)`` while each keeps its own group's scale, so the stored format
    is the plain one (no ``g_idx``) and compressed-tensors 0.20 and vLLM load it as
    such; llm-compressor records its GPTQ runs the same way. Rows of such a group that
    were rounded to nearest are listed in ``k3convert.calibration.rtn_fallbacks``."""
    opts = (provenance or {}).get("options") or {}
    algo = (provenance or {}).get("algorithm") or ""
    if calibrated is None or "gptq" not in algo or not opts.get("act_order"):
        return
    groups = (cfg.get("quantization_config") or {}).get("config_groups") or {}
    solved = set(calibrated.part_rows) - set(calibrated.fallbacks)
    used = {r.scheme for r in plan.quantized if r.name in solved}
    for i, scheme in enumerate(plan.distinct_schemes()):
        g = groups.get(f"group_{i}")
        if scheme in used and g is not None and isinstance(g.get("weights"), dict):
            g["weights"]["actorder"] = "static"


def quantize(
    *,
    src: str | os.PathLike,
    out: str | os.PathLike,
    scheme: str | None = None,
    recipe=None,
    keep: Sequence[str] = (),
    default_keep: bool = True,
    kept_as_stored: bool = True,
    dry_run: bool = False,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
    shard_size: int = DEFAULT_SHARD_SIZE,
    input_scales: Mapping[str, float | torch.Tensor] | None = None,
    calibrate=None,
    algorithm: str = "rtn",
    log=None,
    auto_keep: str | None = None,
    auto_keep_scheme: str | None = None,
    sensitivity: str = "layer",
    plot: str | os.PathLike | None = None,
    sensitivity_data=None,
    serving=None,
    weight_observer: str | None = None,
) -> QuantizeResult:
    """Quantize ``src`` into a compressed-tensors Hugging Face directory ``out``.

    scheme: a registered scheme name for every quantizable Linear (``fp8-block``,
    ``w4a16``, ...), or recipe: a recipe path / :class:`k3convert.recipe.Recipe` with
    ordered rules. keep: extra patterns to keep (glob or ``re:``); default_keep=False
    drops the architecture's default exceptions. kept_as_stored: a kept tensor of an
    encoded source stays as released where a scheme describes its format (False:
    dequantized in the config dtype). dry_run: resolve and return the plan,
    write nothing. input_scales: module name -> static input scale, required by schemes
    with static activations (``fp8``), normally supplied by calibration; for NVFP4
    activations (``nvfp4``) the module's input global scale (1.0 when not given).

    calibrate: a :class:`k3convert.calibrate.sequential.SequentialOptions` runs
    layer-sequential calibration on the runtime first (dataset, samples, GPTQ options,
    offload_dir); algorithm: ``gptq`` (GPTQ weights for int / FP8 schemes), ``static``
    or ``rtn`` (round to nearest); with any of them the static input scales of the
    decoder layers' Linears come from calibration (explicit ``input_scales`` win). The
    resume journal lives in ``offload_dir`` or ``OUT.calib/`` and is removed once OUT is
    written. log: called with one line per calibrated layer.

    auto_keep: a budget (``5%``, ``1.5GB``, ``4.5bpw``; :func:`k3convert.calibrate.
    sensitivity.parse_budget`) for budgeted exceptions: every quantized tensor's
    sensitivity is measured on the calibration set (``calibrate``'s dataset options, or
    the built-in set) with ``sensitivity`` (``layer``, ``output`` or ``kl``), and the
    most sensitive ones within the budget are kept in high precision, or moved to
    ``auto_keep_scheme`` (a scheme ladder, e.g. ``w8a16``-like ``int8-g128``) when given;
    the report is written to ``OUT/sensitivity.json`` and, with ``plot``, as a PNG chart.
    sensitivity_data: SequentialOptions whose dataset options the scan uses when
    ``calibrate`` is not given.

    serving: a :class:`k3convert.serving.ServingTarget` (engine device class, tp,
    strict): every tensor vLLM would refuse is reported through ``log`` as a warning
    (also in ``QuantizeResult.plan.warnings``), or, strict, raised before any work.

    weight_observer: ``mse`` searches each group's clip ratio for every integer scheme
    of the plan (round to nearest, GPTQ's fixed scales, and the AWQ rows its clip step
    does not search: no tokens, per-channel schemes; :mod:`.mse_observer`), ``minmax``
    the full range; None: the schemes' own (a recipe rule can set ``observer: mse`` in
    its options).
    """
    t0 = time.perf_counter()
    if workers is None:
        workers = default_workers()
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    out = Path(out)
    from ..parallel import procs

    group = procs.current()

    p = prepare_quantization(
        src=src, scheme=scheme, recipe=recipe, keep=keep, default_keep=default_keep,
        kept_as_stored=kept_as_stored, input_scales=input_scales, calibrate=calibrate,
        algorithm=algorithm, log=log if group.leader else None, auto_keep=auto_keep,
        auto_keep_scheme=auto_keep_scheme, sensitivity=sensitivity, plot=plot,
        sensitivity_data=sensitivity_data, workers=workers, dry_run=dry_run,
        check_out=lambda need, root: check_output(out, force=force, need_bytes=need,
                                                  source=root),
        journal=None, out=out, force=force, group=group, serving=serving,
        weight_observer=weight_observer,
    )  # fmt: skip
    plan, sens, sel = p.plan, p.sensitivity, p.selection
    if p.serving and group.leader:
        from ..serving import report

        report(p.serving, log=None if dry_run else log, plan=plan)  # dry run: in the table
    if dry_run:
        if sens is not None and p.plot is not None:
            sens.plot(p.plot)
        return QuantizeResult(None, plan, True, sensitivity=sens, selection=sel)
    calibrated = p.calibrated
    nfiles, routing = write_checkpoint(p, out, force=force, progress=progress,
                                       shard_size=shard_size, workers=workers,
                                       group=group)  # fmt: skip
    if calibrated is not None and group.leader:
        calibrated.cleanup()
    if sens is not None and p.plot is not None and group.leader:
        sens.plot(p.plot)
    return QuantizeResult(out, plan, False, time.perf_counter() - t0, nfiles, calibrated,
                          out / routing if routing else None, sens, sel,
                          p.fidelity if p.fidelity else None)  # fmt: skip


def write_checkpoint(
    p: Prepared, out: Path, *, force: bool = False, progress: bool = True,
    shard_size: int = DEFAULT_SHARD_SIZE, workers: int | None = None, group=None,
) -> tuple[int, str | None]:  # fmt: skip
    """Write the prepared quantization as a compressed-tensors directory ``out`` (staged,
    renamed when complete); (files written, the routing counts file name or None).
    group: the torchrun job (default: a group of one): process 0 stages the directory,
    every process writes its share of the files, process 0 writes the rest and renames."""
    from contextlib import ExitStack

    from ..parallel import procs

    group = group if group is not None else procs.ProcessGroup()
    ckpt, plan = p.ckpt, p.plan
    workers = workers or default_workers()
    need = plan.totals()[1] + sum(f.stat().st_size for f in ckpt.aux_files)
    with ExitStack() as stack:
        tmp = err = None
        if group.leader:
            try:
                tmp = stack.enter_context(
                    staged_output(Path(out), force=force, need_bytes=need, source=ckpt.root)
                )
            except Exception as e:
                if group.world == 1:
                    raise
                err = e
        group.agree(err, f"preparing {out}")
        tmp = group.share(tmp)
        nfiles, p.fidelity = _write(ckpt, plan, tmp, shard_size, workers, progress,
                                    p.input_scales, p.shared, p.calibrated, p.kv_tensors,
                                    group)  # fmt: skip
        routing = None
        if group.leader:
            try:
                for f in ckpt.aux_files:  # a source's own loss report is not this run's
                    if f.name != fidelity.FILE:
                        shutil.copy2(f, tmp / f.name)
                cfg = json.dumps(p.output_config(), indent=2) + "\n"
                (tmp / "config.json").write_text(cfg)
                if p.selection is not None:
                    p.sensitivity.write(tmp / "sensitivity.json")
                routing = _write_routing_counts(tmp, p.calibrated)
            except Exception as e:
                if group.world == 1:
                    raise
                err = e
    group.agree(err, f"committing {out}")
    return nfiles, group.share(routing)


def _on_leader(group, fn, what: str):
    """``fn()`` on process 0 alone, its (picklable) result shared with the others."""
    if group.world == 1:
        return fn()
    err = res = None
    if group.leader:
        try:
            res = fn()
        except Exception as e:
            err = e
    group.agree(err, what)
    return group.share(res)


@dataclass
class Prepared:
    """Everything decided before the first output byte: the plan (after auto-keep), the
    calibration's result and the values the writer needs."""

    ckpt: object
    plan: Plan
    input_scales: dict
    shared: dict
    calibrated: object | None = None
    kv_tensors: dict | None = None
    provenance: dict | None = None
    sensitivity: object | None = None
    selection: object | None = None
    plot: str | os.PathLike | None = None
    #: what the serving target would refuse (:func:`k3convert.serving.check_plan`)
    serving: list = dataclasses.field(default_factory=list)
    #: set by :func:`write_checkpoint`: what re-encoding the release did to its values
    fidelity: fidelity.LossReport | None = None

    def output_config(self) -> dict:
        """config.json of the quantized checkpoint."""
        cfg = _output_config(self.ckpt.config, self.plan, Path(self.ckpt.root),
                             self.provenance, self.kv_tensors)  # fmt: skip
        _mark_actorder(cfg, self.plan, self.calibrated, self.provenance)
        if self.selection is not None:
            cfg["k3convert"]["auto_keep"] = self.selection.to_json()
        return cfg


def prepare_quantization(
    *,
    src,
    scheme: str | None = None,
    recipe=None,
    keep: Sequence[str] = (),
    default_keep: bool = True,
    kept_as_stored: bool = True,
    input_scales: Mapping | None = None,
    calibrate=None,
    algorithm: str = "rtn",
    log=None,
    auto_keep: str | None = None,
    auto_keep_scheme: str | None = None,
    sensitivity: str = "layer",
    plot=None,
    sensitivity_data=None,
    workers: int = 1,
    dry_run: bool = False,
    check_out=None,
    journal: Path | None = None,
    out: Path | None = None,
    force: bool = False,
    plan_only: bool = False,
    group=None,
    serving=None,
    weight_observer: str | None = None,
) -> Prepared:
    """:func:`quantize` up to its first output byte: the plan, the auto-keep scan, the
    calibration and the fused global scales. check_out(need_bytes): checks OUT before
    hours of scanning / calibrating; journal: the calibration journal (default
    ``OUT.calib/``); plan_only: stop after the plan and every check that needs no data
    (``convert`` validates a recipe this way before any work). group: the torchrun job
    (every process calls this): the sensitivity scan runs on process 0 and its choice is
    shared; calibration runs on every process together
    (:func:`k3convert.calibrate.sequential.calibrate_sequential`). serving: a
    :class:`k3convert.serving.ServingTarget`: the plan is checked against it before any
    scan or calibration (``Prepared.serving`` holds the problems; strict raises)."""
    from ..parallel.procs import ProcessGroup

    group = group if group is not None else ProcessGroup()
    if (scheme is None) == (recipe is None):
        raise ConfigError("give exactly one of --scheme NAME or --recipe R.yaml.")
    if isinstance(recipe, (str, os.PathLike)):
        from ..recipe import load_recipe

        recipe = load_recipe(recipe)
    if recipe is not None:
        recipe.require_quantize()
    if recipe is not None and calibrate is None and recipe.quantize.calibrate is not None:
        calibrate = recipe.quantize.calibrate.options()  # the recipe's calibration section
        algorithm = recipe.quantize.calibrate.algorithm
    if recipe is not None and auto_keep is None and recipe.quantize.auto_keep is not None:
        ak = recipe.quantize.auto_keep
        auto_keep, auto_keep_scheme, sensitivity, plot = (
            ak.budget,
            ak.scheme,
            ak.sensitivity,
            ak.plot,
        )
    ckpt, plan = plan_quantization(
        src=src, scheme=scheme, recipe=recipe, keep=keep, default_keep=default_keep,
        kept_as_stored=kept_as_stored, weight_observer=weight_observer,
    )  # fmt: skip
    input_scales = dict(input_scales or {})
    if calibrate is None and algorithm != "rtn":
        raise ConfigError(f"algorithm '{algorithm}' needs calibration (pass calibrate=...).")
    if calibrate is not None:
        from ..calibrate.sequential import check_algorithm

        calibrate.check()
        check_algorithm(plan, algorithm)
        _check_source_kv(ckpt, plan, calibrate)
    if plot is not None and auto_keep is None:
        raise ConfigError("plot is the sensitivity chart of auto_keep; give auto_keep too.")
    if auto_keep is not None and plot is not None:
        guard_out(plot, [ckpt.root])
        parent = Path(plot).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise OutputError(
                f"{plot}: the chart's directory {parent} does not exist or is not "
                f"writable; create it or choose another --plot path."
            )
    if auto_keep is not None:
        from ..calibrate.sensitivity import parse_budget

        parse_budget(auto_keep)
    _check_input_scales(plan, input_scales, calibrate)
    prepared = Prepared(ckpt, plan, input_scales, {}, plot=plot)
    if serving is not None:
        prepared.serving = serving.check(plan, ckpt.config)  # strict: raises here
    if plan_only:
        return prepared
    sens = sel = scan_set = None
    if auto_keep is not None:
        if not dry_run and check_out is not None:  # before the scan, not after it
            check_out(plan.totals()[1], ckpt.root)

        def scan():
            return _auto_keep(ckpt, plan, auto_keep, auto_keep_scheme, sensitivity,
                              sensitivity_data or calibrate, log)  # fmt: skip

        plan, sens, sel, scan_set = _on_leader(group, scan, "the sensitivity scan")
        if calibrate is not None:
            from ..calibrate.sequential import check_algorithm

            check_algorithm(plan, algorithm)
        _check_input_scales(plan, input_scales, calibrate)
    prepared.plan, prepared.sensitivity, prepared.selection = plan, sens, sel
    if dry_run:
        return prepared
    need = plan.totals()[1] + sum(f.stat().st_size for f in ckpt.aux_files)
    if calibrate is not None:
        # OUT is checked before hours of calibration, not after
        if check_out is not None:
            check_out(need, ckpt.root)
        # the scan's set is calibration's too when both come from the same options
        reuse = scan_set if sensitivity_data is None else None
        calibrated = _calibrate(ckpt, plan, out, force, calibrate, algorithm, log, reuse,
                                journal=journal, group=group)  # fmt: skip
        prepared.calibrated = calibrated
        prepared.input_scales = {**calibrated.input_scales, **input_scales}
        provenance = {
            "algorithm": algorithm,
            "dataset": calibrated.calibration,
            "options": calibrate.algorithm_options(algorithm),
            "rtn_fallbacks": list(calibrated.fallbacks),
        }
        if calibrate.kv_cache:
            from .kvcache import kv_scale_tensors

            prepared.kv_tensors = kv_scale_tensors(calibrated.kv_absmax, ckpt.config)
        if calibrated.smoothing:
            provenance["smoothed_mappings"] = sum(
                v is not None for v in calibrated.smoothing.values()
            )
            provenance["mappings"] = len(calibrated.smoothing)
        prepared.provenance = provenance
    fuse_scales(prepared, workers)
    return prepared


def fuse_scales(prepared: Prepared, workers: int = 1) -> None:
    """The last step of a preparation: the fused NVFP4 sets' shared largest |value|
    (one pass over those tensors; nothing for other schemes). A ``plan_only`` preparation
    that needs no calibration is complete after it (``convert`` uses it so)."""
    with _torch_threads(1 if workers > 1 else torch.get_num_threads()):
        prepared.shared = _shared_amax(prepared.ckpt, prepared.plan, workers)


class UncalibratedInputWarning(UserWarning):
    """NVFP4 Linears written with ``input_global_scale`` 1.0: no calibration reached them."""


def _check_input_scales(plan: Plan, input_scales: Mapping, calibrate) -> None:
    missing = [r.module for r in plan.quantized if r.scheme.needs_input_scale]
    missing = [m for m in missing if m not in input_scales]
    reached = _calibrated_modules(plan) if calibrate is not None else set()
    if calibrate is not None:  # decoder layers' scales come from calibration
        missing = [m for m in missing if m not in reached]
    nv = [r.module for r in plan.quantized if not r.as_stored and r.scheme.act is not None
          and r.scheme.act.strategy == "tensor_group" and r.module not in input_scales
          and r.module not in reached]  # fmt: skip
    if nv:
        warnings.warn(
            f"{len(nv)} NVFP4 Linear(s) get input_global_scale 1.0 (e.g. '{nv[0]}'): no "
            f"calibration sets it, so activations above 2688 in magnitude saturate and the "
            f"smallest lose their low bits. Calibrate them (--calibrate; a recipe's "
            f"quantize.calibrate) or keep them (--keep).",
            UncalibratedInputWarning,
            stacklevel=3,
        )
    if missing:
        raise ConfigError(
            f"scheme '{next(r.scheme.name for r in plan.quantized if r.module == missing[0])}' "
            f"uses static per-tensor input scales, which come from calibration; "
            f"{len(missing)} module(s) have none (e.g. '{missing[0]}'). Run calibration "
            f"first, or use a dynamic scheme such as fp8-dynamic or fp8-block."
        )


def _check_source_kv(ckpt, plan: Plan, opts) -> None:
    """A source that carries KV-cache scales keeps them as they are: refuse recalibrating
    them over it (``kv_cache``) and the smoothing sites that would change what enters the
    cache (``v_proj -> o_proj``, ``kv_a_layernorm -> kv_b_proj``: the engine skips them
    when the plan keeps KV-cache scales, which would otherwise be stale)."""
    have = [r.name for r in plan.rows if r.name.endswith((".k_scale", ".v_scale"))]
    if not have:
        return
    if opts.kv_cache:
        raise ConfigError(
            f"{ckpt.root}: the source already carries KV-cache scales (e.g. '{have[0]}'); "
            f"quantize it without --kv-cache, or from a source without them."
        )


def _auto_keep(ckpt, plan: Plan, budget, ladder, method: str, opts, log):
    """The sensitivity scan on the calibration set and the budgeted selection applied:
    (new plan, report, selection, the calibration set). The budget and the ladder are
    checked first."""
    from ..calibrate.data import build_calibration_set
    from ..calibrate.sensitivity import auto_keep, parse_budget
    from ..calibrate.sequential import SequentialOptions

    b = parse_budget(budget)
    opts = opts if opts is not None else SequentialOptions()
    calib = build_calibration_set(
        ckpt.root, opts.dataset, num_samples=opts.num_samples, seq_len=opts.seq_len,
        seed=opts.seed, packing=opts.packing,
    )  # fmt: skip
    new_plan, report, sel = auto_keep(ckpt, plan, calib, b, ladder=ladder, method=method,
                                      batch_size=opts.batch_size, dtype=opts.dtype,
                                      log=log)  # fmt: skip
    return new_plan, report, sel, calib


def routing_counts_doc(calibrated) -> dict:
    """``routing_counts.json``: per MoE layer the real calibration tokens the router sent
    each expert, under ``"layers"`` as ``shard --expert-load`` reads it, with the
    calibration set's fingerprint and token count."""
    cal = calibrated.calibration or {}
    return {
        "format": "k3convert-routing-counts-v1",
        "dataset": cal.get("source"),
        "dataset_fingerprint": cal.get("fingerprint"),
        "tokens": cal.get("tokens"),
        "top_k": calibrated.top_k,
        "layers": {str(k): list(v) for k, v in sorted(calibrated.routing_counts.items())},
    }


def _write_routing_counts(tmp: Path, calibrated) -> str | None:
    """Write :func:`routing_counts_doc` into ``tmp``; None when nothing was routed."""
    if calibrated is None or not calibrated.routing_counts:
        return None
    from ..shard.plan import ROUTING_COUNTS

    doc = routing_counts_doc(calibrated)
    (tmp / ROUTING_COUNTS).write_text(json.dumps(doc, indent=1) + "\n")
    return ROUTING_COUNTS


def _calibrated_modules(plan: Plan) -> set[str]:
    """The modules layer-sequential calibration reaches: decoder layers' Linears (not the
    head, the vision tower or MTP layers, which the runtime does not run)."""
    return {r.module for r in plan.rows
            if r.role.layer is not None and r.role.unit.startswith("layer.")}  # fmt: skip


def _calibrate(
    ckpt, plan: Plan, out: Path, force: bool, opts, algorithm: str, log, calib=None,
    journal: Path | None = None, group=None,
):  # fmt: skip
    """Build the calibration set and run layer-sequential calibration (before anything
    is written: a bad dataset or an existing OUT fails first). journal: given by a caller
    that owns OUT's resumption (convert); default ``OUT.calib/`` next to a new OUT."""
    from ..calibrate.data import build_calibration_set
    from ..calibrate.sequential import calibrate_sequential

    if journal is None and out.exists() and not force:
        raise OutputError(f"{out} already exists; choose another OUT or pass --force.")
    if calib is None:  # (else: the set the sensitivity scan built from the same options)
        calib = build_calibration_set(
            ckpt.root, opts.dataset, num_samples=opts.num_samples, seq_len=opts.seq_len,
            seed=opts.seed, packing=opts.packing,
        )  # fmt: skip
    if opts.offload_dir:
        journal = Path(opts.offload_dir)
    elif journal is None:
        journal = out.parent / f"{out.name}.calib"
    # the journal is emptied and removed by its owner: never the source, OUT or inside them
    guard_out(journal, [ckpt.root, out])
    if journal.exists() and not journal.is_dir():
        raise OutputError(
            f"{journal}: the calibration journal / --offload-dir exists and is not a "
            f"directory; remove it or choose another --offload-dir."
        )
    try:
        return calibrate_sequential(
            ckpt,
            plan,
            calib,
            algorithm=algorithm,
            options=opts,
            journal=journal,
            log=log,
            group=group,
        )
    except OSError as e:  # disk full or read-only while writing the journal / spill
        raise write_error(e, journal, "writing the calibration journal") from e


def _job(
    ckpt, r: Decision, w: SafetensorsWriter, input_scales: Mapping, shared: Mapping,
    calibrated=None, losses: list | None = None,
) -> Decision:  # fmt: skip
    """Produce row ``r``'s output tensors and write each at its place in the file. A
    tensor kept bit for bit from a safetensors source is checked for NaN / Inf one chunk
    at a time and copied by the kernel: it never passes through this process whole."""
    if r.as_stored:
        _copy_parts(ckpt, r, w)
        return r
    smoothed = calibrated.kept_tensor(r.name) if calibrated is not None and r.kept else None
    if smoothed is not None:  # a kept tensor calibration's smoothing changed (a norm)
        _check_finite(r.name, smoothed, ckpt.root)
        w.put(r.name, smoothed.to(r.out_dtype))
        return r
    main = ckpt.meta(r.name).parts.get("weight")
    if r.kept and not r.encoded and main is not None and main.raw is not None:
        _check_finite_chunks(r.name, main.file, main.raw, ckpt.root)
        w.copy_from(r.name, main.file, main.raw)
        return r
    tensors = _produce(ckpt, r, input_scales, shared, calibrated, losses)
    for name, dt, shape in _entries(r):
        t = tensors.pop(name)
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name}: produced {t.dtype}{tuple(t.shape)}, planned {dt}{shape}")
        _check_scale(name, t, ckpt.root)
        w.put(name, t)
        del t
    return r


def _copy_parts(ckpt, r: Decision, w: SafetensorsWriter) -> None:
    """An as-stored row: every part copied unchanged (by the kernel from a safetensors
    source), its scales checked first (:func:`stored_parts`)."""
    parts = ckpt.meta(r.name).parts
    for name, t in stored_parts(ckpt, r).items():
        pm = parts[name[len(r.module) + 1 :]]
        if pm.raw is not None:
            w.copy_from(name, pm.file, pm.raw)
        else:
            w.put(name, t)


def stored_parts(ckpt, r: Decision) -> dict[str, torch.Tensor]:
    """An as-stored row's parts by output name (mapped views, no copies), its scales
    checked (non-finite floats; an E8M0 exponent of 255 is NaN)."""
    stored = ckpt.get_parts(r.name)
    out = {}
    for name, _, _ in _entries(r):
        part = name[len(r.module) + 1 :]
        t = stored[part]
        if part.endswith("scale"):
            if t.dtype == torch.uint8 and bool((t == 255).any()):
                raise NonFiniteWeightError(
                    f"{ckpt.root}: '{name}' holds {int((t == 255).sum())} E8M0 exponent(s) "
                    f"of 255 (NaN); the source is corrupt - fix or re-download it."
                )
            _check_scale(name, t, ckpt.root)
        out[name] = t
    return out


def row_tensors(
    ckpt,
    r: Decision,
    input_scales: Mapping,
    shared: Mapping,
    calibrated=None,
    losses: list | None = None,
) -> dict[str, torch.Tensor]:
    """Row ``r``'s output tensors by output name, exactly what :func:`_job` writes for
    it, checked the same way (``convert`` streams them into units instead); its loss
    against the release appended to ``losses`` (see :func:`_produce`)."""
    if r.as_stored:
        return stored_parts(ckpt, r)
    smoothed = calibrated.kept_tensor(r.name) if calibrated is not None and r.kept else None
    if smoothed is not None:
        _check_finite(r.name, smoothed, ckpt.root)
        return {r.name: smoothed.to(r.out_dtype)}
    main = ckpt.meta(r.name).parts.get("weight")
    if r.kept and not r.encoded and main is not None and main.raw is not None:
        _check_finite_chunks(r.name, main.file, main.raw, ckpt.root)
        return {r.name: ckpt.get_parts(r.name)["weight"]}
    tensors = _produce(ckpt, r, input_scales, shared, calibrated, losses)
    out = {}
    for name, dt, shape in _entries(r):
        t = tensors.pop(name)
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name}: produced {t.dtype}{tuple(t.shape)}, planned {dt}{shape}")
        _check_scale(name, t, ckpt.root)
        out[name] = t
    return out


def output_entries(r: Decision) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor row ``r`` writes."""
    return _entries(r)


def _unordered(fn, items, workers: int):
    """fn over items on ``workers`` threads, results as they finish, at most ``workers``
    in flight (so at most that many tensors are held); the first error cancels what has
    not started and is raised once the running ones end."""
    if workers <= 1:
        for it in items:
            yield fn(it)
        return
    items = iter(items)
    with ThreadPoolExecutor(workers) as ex:
        running = {ex.submit(fn, it) for it in itertools.islice(items, workers)}
        try:
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    yield f.result()
                for it in itertools.islice(items, len(done)):
                    running.add(ex.submit(fn, it))
        finally:
            for f in running:
                f.cancel()


@contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block (restored after). Tensors are
    quantized in parallel on worker threads, one core each: nested OpenMP teams (every
    worker's op fanning out to all cores) oversubscribe the cores, and their spinning
    threads slow everything down when other processes share the machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


#: default workers at most: each holds a tensor and its outputs, and past a few cores the
#: disk, not the CPU, sets the pace
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """The cores this process may run on, at most :data:`MAX_DEFAULT_WORKERS`; under
    torchrun the node's cores shared by its processes (``LOCAL_WORLD_SIZE``)."""
    from ..parallel.procs import cores_per_process

    return max(1, min(cores_per_process(), MAX_DEFAULT_WORKERS))


def _write(
    ckpt, plan: Plan, tmp: Path, shard_size, workers, progress, input_scales, shared=None,
    calibrated=None, extra: Mapping[str, torch.Tensor] | None = None, group=None,
) -> tuple[int, fidelity.LossReport]:  # fmt: skip
    """Write the plan's rows in shard files (and ``extra`` tensors, the calibrated
    KV-cache scales, in a last file of their own); returns the number of files and the
    loss report of every process's rows (:mod:`.fidelity`, written by process 0). group:
    the torchrun job; each process writes its share of the files (balanced by bytes) and
    process 0 the KV file and the index, after :meth:`ProcessGroup.agree`."""
    from ..parallel import procs

    group = group if group is not None else procs.ProcessGroup()
    shards = group_by_size(plan.rows, lambda r: r.out_bytes, shard_size)
    names = shard_names(len(shards) + (1 if extra else 0))
    files = list(zip(names, shards, strict=False))
    mine = procs.balance(files, lambda f: sum(r.out_bytes for r in f[1]), group.world)[group.rank]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, rows in files:
        for name, dt, shape in (e for r in rows for e in _entries(r)):
            weight_map[name] = fname
            total += math.prod(shape) * dt.itemsize
    bar = tqdm(
        total=sum(r.src_bytes for _, rows in mine for r in rows),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"quantize {Path(ckpt.root).name}",
        disable=not progress or not group.leader,
    )
    err = None
    losses: list = []
    try:
        with _torch_threads(1 if workers > 1 else torch.get_num_threads()):
            for fname, rows in mine:
                entries = [e for r in rows for e in _entries(r)]
                with SafetensorsWriter(tmp / fname, entries, {"format": "pt"}) as w:
                    job = lambda r: _job(ckpt, r, w, input_scales, shared or {}, calibrated,  # noqa: E731
                                         losses)  # fmt: skip
                    for r in _unordered(job, rows, workers):
                        bar.update(r.src_bytes)
    except Exception as e:
        if group.world == 1:
            raise
        err = e
    finally:
        bar.close()
    group.agree(err, f"writing its files of {tmp}")
    report = fidelity.LossReport(e for part in group.gather(losses) for e in part)
    if not group.leader:
        return len(names), report
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / names[-1]),
                  metadata={"format": "pt"})  # fmt: skip
        for k, v in extra.items():
            weight_map[k] = names[-1]
            total += v.numel() * v.element_size()
    if len(names) > 1:
        write_index(tmp, weight_map, total)
    if len(report):
        report.write(tmp / fidelity.FILE)
    return len(names), report
