"""The tensors of a quantization plan, streamed one by one into compressed-tensors files.

Nothing holds the model: each tensor is mapped from the source, dequantized if the
source is encoded (an FP8-block release re-quantizes to int4 experts without a bf16
copy), quantized, written at its place in the output file, and dropped; at most
``workers`` tensors are in flight, each worker on one core. Tensors kept as they are
stored are copied by the kernel (``copy_file_range``) after a chunked NaN / Inf check;
a NaN / Inf found while streaming aborts the run. The ``quantize`` job around this
(recipe, plan, checks before the first byte, calibration, the staged OUT renamed when
complete) is :mod:`k3convert.pipeline.quantize`.

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
them and vLLM requires: computed when the writer reaches the set (:class:`SharedScales`),
each member mapped once more for its maximum while its bytes are in the page cache.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import threading
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import __version__ as _k3_version
from .. import formats as fmt
from ..arch import kv_cache_scheme_of
from ..checkpoint.output import (
    group_by_size,
    shard_names,
    write_index,
)
from ..checkpoint.safetensors_io import SafetensorsWriter, map_chunks
from ..engines.vllm_layers import FUSED_SETS
from ..formats.dtypes import all_finite
from ..parallel import procs
from ..parallel.procs import cores_per_process
from ..units import byte_bar
from . import fidelity, fp4_requant
from .kvcache import kv_cache_scheme
from .planning import row_entries
from .rules import Decision, Plan
from .schemes import NonFiniteWeightError

DEFAULT_SHARD_SIZE = 4 << 30


def fused_groups(plan: Plan) -> list[list[Decision]]:
    """Sets of rows (>= 2) that share one NVFP4 global scale: siblings of one parent
    module in a ``FUSED_SETS`` entry (``engines.vllm_layers``: the Linears a serving
    engine runs as one matmul), every one of them stored under a scheme with a
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
    MXFP4 -> NVFP4 transcode, :func:`fp4_requant.nvfp4_exact`). smoothed: calibration's
    value for a set whose members smoothing changed (the largest |value| after smoothing;
    every member's parts are then calibration's)."""

    amax: torch.Tensor
    top_code: int | None
    smoothed: bool = False


def _member_scale(ckpt, r: Decision) -> tuple[torch.Tensor, int | None, bool]:
    """(largest |value|, largest E8M0 code of a nonzero group or None, from MXFP4 group
    maxima) of one fused-set member: an MXFP4 source under a scheme the byte paths take
    from one pass over its group maxima (no decode), anything else from the scheme."""
    if ckpt.meta(r.name).encoding == fmt.MXFP4 and fp4_requant.supported(r.scheme):
        got = fp4_requant.abs_max_and_top(ckpt.get_parts(r.name))
        if got is not None:
            return got[0], got[1], True
    w = ckpt.get(r.name)
    try:
        return r.scheme.abs_max(w, name=r.name), None, False
    except NonFiniteWeightError as e:
        raise NonFiniteWeightError(f"{ckpt.root}: {e}") from None


def _set_scale(ckpt, members: list[Decision]) -> SharedScale:
    got = [_member_scale(ckpt, r) for r in members]
    top = torch.stack([g[0] for g in got]).amax()
    codes = [g[1] for g in got if g[1] is not None]
    return SharedScale(top, max(codes) if all(g[2] for g in got) and codes else None)


class SharedScales:
    """Tensor name -> what its fused set shares (see :class:`SharedScale`), each set's
    computed when a member is first produced (``get``) and kept (two small values a set).

    Why not before the first byte: a set's members (w1 / w3 of one expert, q / k / v of
    one attention) are written next to each other, so their bytes are read for the
    maximum and then for the transcode while they are in the page cache; a pass over
    every set first reads them twice from disk where the source does not fit in memory
    (a release never does: 2/3 of K3's expert bytes are w1 / w3). Thread-safe: one
    worker computes a set, the others wait for it; every process computes the same values
    from the same bytes."""

    def __init__(self, ckpt, plan: Plan):
        self._ckpt = ckpt
        self._sets = fused_groups(plan)
        self._set_of = {r.name: i for i, g in enumerate(self._sets) for r in g}
        self._done: dict[int, SharedScale] = {}
        self._lock = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def __bool__(self) -> bool:
        return bool(self._sets)

    def check_release(self) -> None:
        """Refuse, before the first output byte, a member stored as MXFP4 whose decode is
        not finite (:func:`.fp4_requant.decodes_finite`; the scale bytes alone settle the
        common case, so this reads 1/17 of the members' bytes), as the float path would
        (one line naming the tensor). Members of other encodings are checked when the
        writer reaches them (a damaged bf16 source fails then; the staged OUT is removed)."""
        for r in (r for g in self._sets for r in g):
            if self._ckpt.meta(r.name).encoding != fmt.MXFP4:
                continue
            parts = self._ckpt.get_parts(r.name)
            packed, codes = parts.get("weight_packed"), parts.get("weight_scale")
            if packed is None or codes is None:
                continue
            if not fp4_requant.decodes_finite(packed.contiguous(), codes.contiguous()):
                r.scheme.abs_max(self._ckpt.get(r.name), name=r.name)  # raises, naming it

    def members(self, name: str) -> tuple[str, ...]:
        """The tensor names of ``name``'s fused set (() if it is in none)."""
        i = self._set_of.get(name)
        return () if i is None else tuple(r.name for r in self._sets[i])

    def get(self, name: str, default=None) -> SharedScale | None:
        i = self._set_of.get(name)
        if i is None:
            return default
        with self._lock:
            lock = self._locks.setdefault(i, threading.Lock())
        with lock:
            if i not in self._done:
                self._done[i] = _set_scale(self._ckpt, self._sets[i])
            return self._done[i]


def shared_amax(ckpt, plan: Plan) -> SharedScales:
    """The fused sets' shared scales, computed as their members are produced (see
    :class:`SharedScales`)."""
    return SharedScales(ckpt, plan)


def _checked(dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` can be NaN / Inf worth refusing (fp8 has no Inf and
    its NaN comes from the source as stored; integers have neither)."""
    return dtype.is_floating_point and dtype.itemsize > 1


def _non_finite(name: str, bad: int, where: Path) -> NonFiniteWeightError:
    return NonFiniteWeightError(
        f"{where}: tensor '{name}' holds {bad} NaN/Inf value(s); the source is "
        f"corrupt - fix or re-download it (nothing was written to the output)."
    )


def _check_finite(name: str, t: torch.Tensor, where: Path) -> None:
    """NaN / Inf in a tensor copied as it is (the count is taken only for the message).
    Quantized tensors are not checked here: every scheme takes the maximum of every
    group and refuses a non-finite one (:func:`_produce` names the file)."""
    if _checked(t.dtype) and not all_finite(t):
        raise _non_finite(name, int((~torch.isfinite(t)).sum()), where)


def _check_finite_chunks(name: str, path: Path, info, where: Path) -> None:
    """:func:`_check_finite` over a stored tensor, one mapped chunk at a time."""
    if not _checked(info.dtype) or all(all_finite(c) for c in map_chunks(path, info)):
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
    measured = losses is not None and re_encodes(r)
    stats: dict | None = {} if measured else None  # what the transcode knows of its loss
    if parts is None:
        share = shared.get(r.name) if shared else None
        kw = {} if share is None else {"global_amax": share.amax, "top_code": share.top_code}
        try:
            parts = quantize_stored(ckpt, r.name, r.scheme, stats=stats, **kw)
        except NonFiniteWeightError as e:  # the scheme names the tensor; add the checkpoint
            raise NonFiniteWeightError(f"{ckpt.root}: {e}") from None
    if measured:
        losses.append(release_loss(ckpt, r, parts, exact=stats.get("exact", False),
                                   sums=stats.get("loss")))  # fmt: skip
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


def release_loss(ckpt, r: Decision, parts: Mapping[str, torch.Tensor], *, exact: bool = False,
                 sums: Mapping | None = None):  # fmt: skip
    """Row ``r``'s :class:`.fidelity.TensorLoss` against the release's decode (a row that
    :func:`re_encodes`; ``parts``: its weight parts under ``r.scheme``). exact: known to
    hold every value; sums: what the transcode measured while rounding (see
    :func:`.fidelity.from_sums`). Either way no comparison is run; otherwise the release
    and the output are decoded and compared (:func:`.fidelity.measure`)."""
    m = ckpt.meta(r.name)
    enc = fmt.ENCODINGS[m.encoding]
    scale = m.parts.get(enc.scale_part)
    try:
        group = fmt.scale_block(tuple(scale.shape), tuple(m.shape), m.quant.block)
    except (AttributeError, ValueError):
        group = (1, m.shape[1])
    if exact:
        return fidelity.exact(r.name, m.encoding, r.scheme.name, m.shape, group)
    if sums is not None:
        return fidelity.from_sums(r.name, m.encoding, r.scheme.name, m.shape, group, sums)
    return fidelity.measure(r.name, m.encoding, r.scheme.name, ckpt.get(r.name),
                            r.scheme.dequantize(parts), group)  # fmt: skip


def _check_scale(name: str, t: torch.Tensor, where: Path) -> None:
    """Last line of defence: no scale (weight_scale, input_scale) is written non-finite."""
    if not (name.endswith("_scale") and t.dtype.is_floating_point):
        return
    if t.dtype == torch.float8_e4m3fn:  # no inf: its NaN bytes, s1111111, on the raw bytes
        bad = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    else:  # one min / max reduction (13x isfinite().all() on bf16), counted only if bad
        t = t.float() if t.dtype.itemsize == 1 else t
        bad = 0 if all_finite(t) else int((~torch.isfinite(t)).sum())
    if bad:
        raise NonFiniteWeightError(
            f"{where}: refusing to write '{name}': {bad} of its {t.numel()} value(s) are "
            f"NaN/Inf; a quantized weight with such a scale dequantizes to garbage. "
            f"Keep the tensor (--keep), or fix the calibration scales that gave it."
        )


def output_config(
    config: dict, plan: Plan, src: Path, calibration: dict | None = None, kv_tensors=None
) -> dict:
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


def mark_actorder(cfg: dict, plan: Plan, calibrated, provenance: dict | None) -> None:
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
    if check_kept_plain(ckpt, r):
        main = ckpt.meta(r.name).parts["weight"]
        w.copy_from(r.name, main.file, main.raw)
        return r
    tensors = _produce(ckpt, r, input_scales, shared, calibrated, losses)
    for name, dt, shape in row_entries(r):
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
    checked first (:func:`check_stored`)."""
    check_stored(ckpt, r)
    stored = ckpt.get_parts(r.name)
    return {name: stored[name[len(r.module) + 1 :]] for name, _, _ in row_entries(r)}


def check_stored(ckpt, r: Decision) -> None:
    """An as-stored row's scales checked (non-finite floats; an E8M0 exponent of 255 is
    NaN), mapping only those."""
    for name, _, _ in row_entries(r):
        part = name[len(r.module) + 1 :]
        if not part.endswith("scale"):
            continue
        t = ckpt.part_tensor(r.name, part)
        if t.dtype == torch.uint8 and bool((t == 255).any()):
            raise NonFiniteWeightError(
                f"{ckpt.root}: '{name}' holds {int((t == 255).sum())} E8M0 exponent(s) "
                f"of 255 (NaN); the source is corrupt - fix or re-download it."
            )
        _check_scale(name, t, ckpt.root)


def check_kept_plain(ckpt, r: Decision) -> bool:
    """Whether ``r`` is a kept row written as its stored plain weight, byte for byte;
    if so, that weight checked for non-finite values first."""
    main = ckpt.meta(r.name).parts.get("weight")
    if not (r.kept and not r.encoded and main is not None and main.raw is not None):
        return False
    _check_finite_chunks(r.name, main.file, main.raw, ckpt.root)
    return True


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
    if check_kept_plain(ckpt, r):
        return {r.name: ckpt.get_parts(r.name)["weight"]}
    tensors = _produce(ckpt, r, input_scales, shared, calibrated, losses)
    out = {}
    for name, dt, shape in row_entries(r):
        t = tensors.pop(name)
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name}: produced {t.dtype}{tuple(t.shape)}, planned {dt}{shape}")
        _check_scale(name, t, ckpt.root)
        out[name] = t
    return out


def output_entries(r: Decision) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor row ``r`` writes."""
    return row_entries(r)


#: rows below this many source bytes are not read ahead (a tiny model's tensors: the
#: advice would cost more than the read)
READ_AHEAD_MIN = 1 << 20


def _read_ahead(ckpt, rows, ahead: int):
    """``rows`` in order, each handed out after the kernel was asked to read the source
    bytes of the row ``ahead`` places later (``posix_fadvise`` WILLNEED: the read runs in
    the background while the rows before it are transcoded and written, as ``cp``'s
    sequential reads are read ahead; without it each tensor's bytes came in by page
    faults, on the worker's clock). Advice only: nothing is read here, a failure is
    ignored."""
    rows = list(rows)
    fds: dict[Path, int] = {}

    def advise(r: Decision) -> None:
        if r.src_bytes < READ_AHEAD_MIN or not hasattr(os, "posix_fadvise"):
            return
        for part in ckpt.meta(r.name).parts.values():
            if part.raw is None or not part.raw.nbytes:  # length 0: "to the end of the file"
                continue
            try:
                fd = fds.get(part.file)
                if fd is None:
                    fd = fds[part.file] = os.open(part.file, os.O_RDONLY | os.O_NONBLOCK)
                os.posix_fadvise(fd, part.raw.start, part.raw.nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    try:
        for r in rows[:ahead]:
            advise(r)
        for i, r in enumerate(rows):
            if i + ahead < len(rows):
                advise(rows[i + ahead])
            yield r
    finally:
        for fd in fds.values():
            os.close(fd)


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
def torch_threads(n: int):
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
    return max(1, min(cores_per_process(), MAX_DEFAULT_WORKERS))


def write_shards(
    ckpt, plan: Plan, tmp: Path, shard_size, workers, progress, input_scales, shared=None,
    calibrated=None, extra: Mapping[str, torch.Tensor] | None = None, group=None,
) -> tuple[int, fidelity.LossReport]:  # fmt: skip
    """Write the plan's rows in shard files (and ``extra`` tensors, the calibrated
    KV-cache scales, in a last file of their own); returns the number of files and the
    loss report of every process's rows (:mod:`.fidelity`, written by process 0). group:
    the torchrun job; each process writes its share of the files (balanced by bytes) and
    process 0 the KV file and the index, after :meth:`ProcessGroup.agree`."""
    group = group if group is not None else procs.ProcessGroup()
    shards = group_by_size(plan.rows, lambda r: r.out_bytes, shard_size)
    names = shard_names(len(shards) + (1 if extra else 0))
    files = list(zip(names, shards, strict=False))
    mine = procs.balance(files, lambda f: sum(r.out_bytes for r in f[1]), group.world)[group.rank]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, rows in files:
        for name, dt, shape in (e for r in rows for e in row_entries(r)):
            weight_map[name] = fname
            total += math.prod(shape) * dt.itemsize
    bar = byte_bar(
        total=sum(r.src_bytes for _, rows in mine for r in rows),
        desc=f"quantize {Path(ckpt.root).name}",
        disable=not progress or not group.leader,
    )
    err = None
    losses: list = []
    try:
        with torch_threads(1 if workers > 1 else torch.get_num_threads()):
            for fname, rows in mine:
                entries = [e for r in rows for e in row_entries(r)]
                with SafetensorsWriter(tmp / fname, entries, {"format": "pt"}) as w:
                    job = lambda r: _job(ckpt, r, w, input_scales, shared or {}, calibrated,  # noqa: E731
                                         losses)  # fmt: skip
                    with closing(_read_ahead(ckpt, rows, workers + 1)) as ahead:
                        for r in _unordered(job, ahead, workers):
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
