"""``convert``: quantize -> shard -> verify in one streaming pass, driven by one recipe.

Nothing is planned twice and no quantized checkpoint is written in between: the
quantization plan becomes a :class:`PlannedCheckpoint` (the checkpoint ``quantize`` would
write: its config.json, tensor names, dtypes, shapes and encodings, but no files), the
shard planner cuts that into units, and each unit's writer asks the planned checkpoint
for the tensors it needs, which quantizes them then (kept tensors are mapped from the
source, bit for bit). A tensor several units read (a TP-split weight: one slice per rank)
is quantized once and cached until its last reader is done, within ``cache_bytes``; past
that the oldest entries are dropped and recomputed when asked again (quantization is
deterministic, so the bytes are the same).

Order of work, and what is checked before any of it:

1. plan (metadata only): the recipe, the source, the quantization plan, every unit of
   the layout (a tp that does not divide the heads, a scheme whose blocks a split would
   cut, an expert load that does not fit: all fail here), the verify inputs;
2. calibrate, when the recipe has ``quantize.calibrate`` (or auto-keep's sensitivity
   scan): layer by layer on the runtime, journaled in ``OUT.calib/`` (or the recipe's
   ``offload_dir``) so a rerun does not redo finished layers;
3. write: the units, journaled in ``OUT/.k3-journal/`` so a rerun skips the finished
   ones; ``manifest.json`` last, atomically;
4. verify: the stream against the source (or the recipe's reference), every rank
   simulated; ``OUT/report.json`` (and, on request, an HTML page) with the sizes, time per
   stage and verify's parity figures.

An interrupted run is resumed by running the same command again: the stream it writes
(manifest, units, carried files) is byte-identical to an uninterrupted run's.

Under ``torchrun`` the processes share the work of step 3 (whole layers to processes,
balanced by bytes, so a TP-split tensor is quantized by one process only); in step 2 every
process runs each layer's calibration forward passes and solves its share of the layer's
GPTQ problems (the routed experts, balanced by cost), exchanging the parts through the
journal (OUT's parent must be on a file system every process sees; auto-keep's scan runs
on process 0 and its choice is shared); process 0 alone commits the manifest and runs
verify.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import __version__
from .arch import resolve, validate_source
from .checkpoint import Checkpoint, open_checkpoint
from .checkpoint.output import check_output, guard_out, reports_write_errors
from .checkpoint.reader import PartMeta, QuantConfig, group_parts, quant_config_of
from .errors import ConfigError, K3Error, OutputError
from .parallel import procs
from .pipeline.quantize import (
    fuse_scales,
    prepare_quantization,
    routing_counts_doc,
    write_checkpoint,
)
from .quant import fidelity
from .quant.writer import output_entries, re_encodes, row_tensors, torch_threads
from .recipe import CALIBRATION, Recipe, apply_overrides, load_recipe, parse_recipe, recipe_to_dict
from .report_html import write_html
from .serving import ServingTarget
from .serving import report as serving_report
from .shard.plan import ROUTING_COUNTS, build_plan
from .shard.writer import ShardResult, carried_files, write_stream
from .stream.format import JOURNAL, MANIFEST
from .stream.reader import load_manifest
from .units import human_bytes
from .verify.report import write_json
from .verify.run import run_verify

#: computed tensors kept for their later readers at most (then recomputed on demand)
DEFAULT_CACHE_BYTES = 2 << 30
REPORT = "report.json"
REPORT_FORMAT = "k3convert-convert-report-v1"
#: where a planned tensor "lives" (messages only: it is never a file)
_PLANNED = "<planned quantized checkpoint>"


class PlannedCheckpoint(Checkpoint):
    """The compressed-tensors checkpoint ``quantize`` would write from ``prepared``
    (:class:`k3convert.pipeline.quantize.Prepared`), as a :class:`Checkpoint` whose tensors are
    produced when read: ``part_tensor(logical, part)`` quantizes the row on first use.

    ``expect(units)`` tells it which unit tensors will be read (the units this process
    writes), so a produced row is dropped right after its last reader."""

    def __init__(self, prepared, cache_bytes: int = DEFAULT_CACHE_BYTES):
        ck = prepared.ckpt
        self.prepared = prepared
        self.config_doc = prepared.output_config()
        raw: dict[str, PartMeta] = {}
        self._row_of: dict[str, object] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        where = Path(ck.root) / _PLANNED
        for r in prepared.plan.rows:
            for name, dt, shape in output_entries(r):
                nbytes = torch.Size(shape).numel() * dt.itemsize
                raw[name] = PartMeta(name, where, dt, tuple(shape), nbytes, None)
                self._row_of[name] = r
            if not r.kept or r.as_stored:
                shapes[r.name] = tuple(r.shape)
        self._extra = dict(prepared.kv_tensors or {})
        for name, t in self._extra.items():
            raw[name] = PartMeta(name, where, t.dtype, tuple(t.shape), t.numel() * t.itemsize)
        metas = group_parts(raw, QuantConfig(quant_config_of(self.config_doc)), None, shapes)
        super().__init__(Path(ck.root), self.config_doc, metas, [])
        self.source = ck
        self.__dict__["aux_files"] = list(ck.aux_files)  # the source's (cached_property)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, dict] = OrderedDict()  # row name -> outputs
        self._held = 0
        self._busy: dict[str, threading.Event] = {}
        self._refs: Counter[str] = Counter()
        self.produced = 0  # rows computed (recomputations included)
        #: mapped-as-stored rows whose values were checked (NaN / Inf, E8M0 255) once
        self._checked: set[str] = set()
        #: row name -> its loss against the release (:mod:`.quant.fidelity`), once per row
        self.losses: dict[str, object] = {}

    def _reads(self, units) -> Counter[str]:
        refs: Counter[str] = Counter()
        for up in units:
            for tp in up.tensors:
                if tp.slice.contents == "local_shape":
                    continue
                pm = self.meta(tp.src_logical).parts[tp.slice.part]
                r = self._row_of.get(pm.name)
                if r is not None:
                    refs[r.name] += 1
        return refs

    def expect(self, units) -> None:
        """Count the reads ``units`` will make, per row."""
        refs = self._reads(units)
        with self._lock:
            self._refs = refs

    def skip(self, unit) -> None:
        """``unit`` will not be written (a rerun found it intact): its reads are not
        coming, so rows it shares are not held for it."""
        with self._lock:
            for name, k in self._reads([unit]).items():
                self._refs[name] -= k
                if self._refs[name] <= 0 and name in self._cache:
                    self._held -= _nbytes(self._cache.pop(name))

    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        return {k: self.part_tensor(name, k) for k in self.meta(name).parts}

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError("a planned checkpoint is read by parts (part_tensor)")

    def part_tensor(self, logical: str, part: str) -> torch.Tensor:
        pm = self.meta(logical).parts[part]
        if pm.name in self._extra:
            return self._extra[pm.name]
        r = self._row_of[pm.name]
        return self._outputs(r)[pm.name]

    def _outputs(self, r) -> dict[str, torch.Tensor]:
        p = self.prepared
        # mapped from the source as stored (not a tensor calibration's smoothing changed)
        smoothed = p.calibrated is not None and r.name in p.calibrated.kept_rows
        cheap = r.as_stored or (r.kept and not r.encoded and not smoothed and self._stored_plain(r))
        if cheap and r.name in self._checked:  # mapped again; checked by its first read
            parts = p.ckpt.get_parts(r.name)
            if r.as_stored:
                return {f"{r.module}.{k}": v for k, v in parts.items()}
            return {r.name: parts["weight"]}
        while True:
            with self._lock:
                hit = self._cache.get(r.name)
                if hit is not None:
                    self._release(r.name)
                    return hit
                ev = self._busy.get(r.name)
                if ev is None:
                    ev = self._busy[r.name] = threading.Event()
                    break
            ev.wait()  # another unit is producing this row: take its result
        losses: list = []
        try:
            out = row_tensors(p.ckpt, r, p.input_scales, p.shared, p.calibrated, losses)
        except BaseException:
            with self._lock:
                self._busy.pop(r.name).set()
            raise
        with self._lock:
            self.produced += 1
            self.losses.update((e.name, e) for e in losses)
            if cheap:
                self._checked.add(r.name)
            if not cheap and self._refs[r.name] > 1:
                self._cache[r.name] = out
                self._held += _nbytes(out)
                self._release(r.name)
                self._evict()
            else:
                self._refs[r.name] -= 1
            self._busy.pop(r.name).set()
        return out

    def _stored_plain(self, r) -> bool:
        main = self.source.meta(r.name).parts.get("weight")
        return main is not None and main.raw is not None

    def _release(self, name: str) -> None:
        """One read of a cached row done (lock held); drop it after its last."""
        self._refs[name] -= 1
        if self._refs[name] <= 0 and name in self._cache:
            self._held -= _nbytes(self._cache.pop(name))

    def _evict(self) -> None:
        while self._held > self.cache_bytes and len(self._cache) > 1:
            _, out = self._cache.popitem(last=False)
            self._held -= _nbytes(out)

    @property
    def held_bytes(self) -> int:
        return self._held


def _nbytes(out: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in out.values())


@dataclass
class ConvertResult:
    out: Path
    report: dict
    passed: bool | None
    seconds: float
    units_written: int = 0
    units_skipped: int = 0
    verify_report: dict | None = field(default=None, repr=False)

    def summary(self) -> str:
        return render_summary(self.report)


def _resolve_recipe(recipe, overrides) -> Recipe:
    if isinstance(recipe, Recipe):
        if overrides:
            doc = apply_overrides(recipe_to_dict(recipe), overrides, recipe.origin)
            return parse_recipe(doc, recipe.origin)
        return recipe
    if recipe is None:
        raise ConfigError("convert needs a recipe (--recipe R.yaml or a preset name).")
    return load_recipe(recipe, overrides)


#: next to the manifest: what a complete OUT was converted from, for a rerun to recognise
SIDECAR = ".k3-convert.json"


def _stream_identity(r: Recipe, ck) -> dict:
    """What a stream's bytes depend on: the source files (names, sizes, mtimes) and the
    recipe's quantize / layout / output format (not verify, workers or descriptions)."""
    d = recipe_to_dict(r)
    return json.loads(json.dumps({
        "source": str(Path(ck.root).resolve()),
        "files": [[str(f.path.relative_to(ck.root)), f.size, f.path.stat().st_mtime_ns]
                  for f in ck.files()],
        "quantize": d["quantize"],
        "layout": d["layout"],
        "output": {k: d["output"][k] for k in ("compression", "unit_hash")},
    }))  # fmt: skip


def _check_out_early(out: Path, force: bool, r: Recipe, ck) -> dict | None:
    """OUT refused before hours of calibration, not after (the writer checks again).
    Returns the sidecar of a complete OUT that this very recipe wrote from this source
    (:func:`_stream_identity`): it is verified again, not rewritten; None when there is
    work to do."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; remove it or choose another OUT.")
    if not out.is_dir() or force:
        return None
    if (out / MANIFEST).is_file():
        try:
            side = json.loads((out / SIDECAR).read_text(encoding="utf-8"))
            same = side.get("identity") == _stream_identity(r, ck)
        except (OSError, ValueError, AttributeError):
            same, side = False, None
        if same:
            return side
        raise OutputError(
            f"{out}: already holds a complete stream ({MANIFEST} present) that this recipe "
            f"did not write from this source as it is now (another recipe, layout or "
            f"source files); pass --force to replace it, or choose another output directory."
        )
    if not (out / JOURNAL).is_dir() and any(out.iterdir()):
        raise OutputError(
            f"{out}: exists, is not empty and is not an interrupted k3convert run (no "
            f"{JOURNAL}/); choose an empty directory or pass --force to replace it."
        )
    return None


def _check_file_out(path, what: str, sources) -> None:
    """A file convert writes at the end (the HTML report): refused now, not after hours."""
    import os

    p = guard_out(path, sources)
    parent = p.resolve().parent
    if p.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise OutputError(
            f"{p}: the {what} cannot be written there (a directory, or a parent that does "
            f"not exist or is not writable); choose another path."
        )


def _fingerprint(prepared, data_config: dict) -> str:
    """What a unit's bytes depend on besides its tensor table and the source files: the
    quantized config (schemes, calibration provenance) and every row's decision."""
    h = hashlib.sha256(json.dumps(data_config, sort_keys=True, default=str).encode())
    if prepared is not None:
        for r in prepared.plan.rows:
            opts = r.scheme.options() if r.scheme is not None else None
            h.update(json.dumps([r.name, r.label, opts, str(r.out_dtype)], default=str).encode())
        for name, t in sorted((prepared.kv_tensors or {}).items()):
            h.update(name.encode() + t.float().numpy().tobytes())
        for name, v in sorted((prepared.input_scales or {}).items()):
            h.update(name.encode() + torch.as_tensor(v).float().numpy().tobytes())
    return h.hexdigest()


class _Display:
    """One progress line for the whole run: stage, current item, rate, ETA."""

    def __init__(self, enabled: bool, stages: list[str]):
        self.stages = stages
        self.bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=not enabled, smoothing=0.1, desc="convert")  # fmt: skip

    def stage(self, name: str, total: float = 0, unit: str = "B") -> None:
        i = self.stages.index(name) + 1
        self.bar.unit = unit
        self.bar.unit_scale = unit == "B"
        self.bar.reset(total=total)
        self.bar.set_postfix_str("", refresh=False)
        self.bar.set_description(f"convert [{i}/{len(self.stages)} {name}]", refresh=True)

    def item(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def write(self, line: str) -> None:
        if self.bar.disable:
            return
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


@reports_write_errors
def convert(
    *,
    src=None,
    out,
    recipe,
    overrides=(),
    keep_intermediate: bool = False,
    force: bool = False,
    progress: bool = True,
    report_html=None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    log=None,
) -> ConvertResult:
    """Run ``recipe`` (a path, a preset name or a :class:`Recipe`; ``overrides``:
    ``["layout.tp=8", ...]``) on ``src`` (default: the recipe's ``source.path``) into the
    stream directory ``out``. keep_intermediate: also write the quantized checkpoint to
    ``OUT.quantized/``. report_html: write an HTML report there. See the module doc."""
    t_start = time.perf_counter()
    times: dict[str, float] = {}
    r = _resolve_recipe(recipe, overrides)
    src = src if src is not None else r.source.path
    if src is None:
        raise ConfigError(
            f"{r.origin}: no source: give SRC on the command line or source.path in the recipe."
        )
    out = Path(out)
    group = procs.current()
    ck = open_checkpoint(src)
    guard_out(out, [ck.root])
    calib_dir = out.parent / f"{out.name}.calib"
    guard_out(calib_dir, [ck.root, out])
    inter = out.parent / f"{out.name}.quantized" if keep_intermediate else None
    if inter is not None:
        guard_out(inter, [ck.root, out])
        if r.quantize is None:
            raise ConfigError(
                f"{r.origin}: --keep-intermediate keeps the quantized checkpoint, but the "
                f"recipe has no quantize section (nothing is quantized)."
            )
    if report_html is not None:
        _check_file_out(report_html, "HTML report", [ck.root, out])
    mt = ck.config.get("model_type")
    if r.source.model_type is not None and mt != r.source.model_type:
        raise ConfigError(
            f"{r.origin}: source.model_type is '{r.source.model_type}' but {ck.root}/config.json "
            f"says '{mt}'; this recipe was written for another model (change or drop "
            f"source.model_type)."
        )
    done = _check_out_early(out, force, r, ck)
    if done is not None and inter is not None:
        raise OutputError(
            f"{out}: already a complete stream of this recipe; --keep-intermediate would "
            f"need the quantization (and calibration) again - pass --force to redo the "
            f"conversion, or run `k3convert quantize` for the checkpoint."
        )
    if inter is not None:
        check_output(inter, force=force, need_bytes=0, source=ck.root)
    stages = [*(["calibrate"] if _needs_data(r) else []), "write",
              *(["verify"] if r.verify.enabled else [])]  # fmt: skip
    ui = _Display(progress and group.leader, stages)
    say = log or ui.write
    try:
        # -- 1. plan: every check that needs no tensor data ---------------------------
        t = time.perf_counter()
        lay = r.layout
        layout = lay.layout()
        placement = dict(
            compression=r.output.compression,
            pp_layers=list(lay.pp_layers) or None,
            redundant_experts=lay.redundant_experts,
        )
        load = None if lay.expert_load in (None, CALIBRATION) else lay.expert_load
        prep = None
        pending = lay.expert_load == CALIBRATION  # counts come after calibration
        if r.quantize is not None:
            with _key_path(r, "quantize"):
                prep = prepare_quantization(src=ck.root, recipe=r, plan_only=True)
            _check_serving(r, prep, ck, say if group.leader else None)
            data: Checkpoint = PlannedCheckpoint(prep, cache_bytes)
        else:
            data = ck
        with _key_path(r, "layout"):  # raises on a layout the model cannot take
            plan = build_plan(data, layout, expert_load=_even_load(data) if pending else load,
                              **placement)  # fmt: skip
        vref = _verify_reference(r, ck)
        times["plan"] = time.perf_counter() - t

        # -- 2. calibrate (and the auto-keep scan) -------------------------------------
        if done is not None:  # a complete stream of this recipe: verify it again
            stages = [s for s in stages if s != "calibrate"]
            ui.stages = stages
        if r.quantize is not None and done is None and _needs_data(r):
            t = time.perf_counter()
            prep = _prepare(r, ck, out, force, calib_dir, group, ui, say)
            data = PlannedCheckpoint(prep, cache_bytes)
            times["calibrate"] = time.perf_counter() - t
        elif r.quantize is not None and done is None:
            fuse_scales(prep)  # the plan-only preparation is complete: no data needed
        if _needs_data(r) and done is None:  # calibration changed the checkpoint: re-plan
            if pending:
                counts = prep.calibrated.routing_counts if prep.calibrated is not None else {}
                if not counts:
                    raise ConfigError(
                        f"{r.origin}: layout.expert_load is 'calibration' but calibration "
                        f"routed no tokens (the model has no MoE layer the runtime calibrates)."
                    )
                load = counts
            plan = build_plan(data, layout, expert_load=load, **placement)
        # (else the plan of step 1 is the one to write: for a complete OUT with
        # expert_load: calibration, its even counts; the manifest holds the real placement)

        # -- 3. write the stream ------------------------------------------------------
        t = time.perf_counter()
        ui.stage("write")
        if done is not None:
            say(f"{out}: already a complete stream of this recipe and source; verifying it")
        carry = _carry_list(ck, prep)
        identity = _fingerprint(prep, data.config)

        workers = r.output.workers or procs.cores_per_process()
        # units are written (and their tensors quantized) on `workers` threads, one core
        # each: nested OpenMP teams would oversubscribe the cores
        with torch_threads(1 if workers > 1 else torch.get_num_threads()):
            res = _from_manifest(out) if done is not None else write_stream(
                data=data, plan=plan, out=out, source=ck, carry=carry,
                compress=r.output.compression, workers=workers, force=force,
                progress=progress, recipe=recipe_to_dict(r), unit_hash=r.output.unit_hash,
                identity=identity, bar=ui.bar, group=group, share_by_layer=True,
                on_unit=lambda up: ui.item(f"rank {up.rank} {up.name}"),
            )  # fmt: skip
        times["write"] = time.perf_counter() - t

        mine = list(data.losses.values()) if isinstance(data, PlannedCheckpoint) else []
        got = {e.name: e for part in group.gather(mine) for e in part}
        # a resumed run produces only the units it writes: the rest are not measured

        todo = [] if prep is None or done is not None else [
            r.name for r in prep.plan.rows if re_encodes(r) and r.name not in got
        ]  # fmt: skip
        losses = fidelity.LossReport(got.values(), todo)
        vrep = report = err = None
        if group.leader:  # the rest is process 0's; the others wait for its verdict
            try:
                report, vrep = _finish(r, ck, out, prep, plan, res, times, t_start, done,
                                       inter, force, vref, report_html, group, ui,
                                       losses)  # fmt: skip
            except Exception as e:
                if group.world == 1:
                    raise
                err = e
        group.agree(err, f"finishing {out} (intermediate checkpoint, verify, report)")
    finally:
        ui.close()
    report = group.share(report)
    return ConvertResult(out, report, report["passed"], report["seconds"]["total"],
                         res.units_written, res.units_skipped, vrep)  # fmt: skip


def _finish(r, ck, out, prep, plan, res, times, t_start, done, inter, force, vref,
            report_html, group, ui, losses=None):  # fmt: skip
    """Process 0, after the stream is committed: the sidecar, the loss report, the
    intermediate checkpoint (before the calibration journal it reads is removed), verify,
    the report files."""
    if done is None and losses is not None and (len(losses) or losses.unmeasured):
        losses.write(out / fidelity.FILE)
    elif done is not None:  # verified again: the report its run wrote, if any
        losses = _read_losses(out)
    if done is None:
        side = {"identity": _stream_identity(r, ck), "quantize": None}
        if prep is not None:
            side["quantize"] = _quantize_summary(prep, run=False)
        (out / SIDECAR).write_text(json.dumps(side, indent=1) + "\n")
    if inter is not None and prep is not None:
        write_checkpoint(prep, inter, force=force, progress=False)
    if prep is not None and prep.calibrated is not None:
        prep.calibrated.cleanup()
    if prep is not None and prep.sensitivity is not None and done is None:
        prep.sensitivity.write(out / "sensitivity.json")
        if prep.plot is not None:
            prep.sensitivity.plot(prep.plot)
    vrep = None
    if r.verify.enabled:
        t = time.perf_counter()
        ui.stage("verify", total=1, unit="run")
        ui.item("every rank simulated, vs " + ("transformers" if vref == "transformers"
                                               else Path(vref).name))  # fmt: skip
        vrep = _run_verify(r, out, vref)
        ui.bar.update(1)
        times["verify"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t_start
    report = _report(r, ck, out, prep, plan, res, times, vrep, group, inter, done, losses)

    write_json(report, out / REPORT)
    if report_html is not None:
        write_html(report, vrep, report_html)
    return report, vrep


@contextmanager
def _key_path(r: Recipe, section: str):
    """A model-dependent check of a recipe section fails naming the section (and the
    recipe) first: ``R.yaml: layout (tp=3 pp=1 moe_tp=3 moe_ep=1): cannot split ...``."""
    try:
        yield
    except K3Error as e:
        where = section
        if section == "layout":
            lay = r.layout.layout()
            where = f"layout (tp={lay.tp} pp={lay.pp} moe_tp={lay.moe_tp} moe_ep={lay.moe_ep})"
        msg = str(e)
        if msg.startswith(f"{r.origin}: {section}"):
            raise
        try:
            err = type(e)(f"{r.origin}: {where}: {msg}")
        except TypeError:  # an error class with its own constructor
            err = ConfigError(f"{r.origin}: {where}: {msg}")
        err.exit_code = e.exit_code
        raise err from None


def _from_manifest(out: Path):
    """The write stage's result for a complete stream found in OUT (nothing written)."""

    man = load_manifest(out)  # validated, the rank files too: damage is a clean error
    units = [u for rk in man["ranks"] for u in rk["units"]]
    return ShardResult(out, out / MANIFEST, 0, len(units), sum(u["bytes"] for u in units), 0.0)


def _even_load(ck) -> dict[int, list[float]]:
    """Equal routing counts for every MoE layer: the placement planned (and checked)
    before calibration has measured the real ones."""
    arch, cfg = resolve(ck.config, f"{ck.root}/config.json")
    roles = validate_source(arch, cfg, ck, str(ck.root))
    layers = {m.role.layer for m in roles.values() if m.role.expert is not None}
    return {L: [1.0] * cfg.num_experts for L in layers}


def _needs_data(r: Recipe) -> bool:
    q = r.quantize
    return q is not None and (q.calibrate is not None or q.auto_keep is not None)


def _check_serving(r: Recipe, prep, ck, log) -> None:
    """vLLM's load-time rules at the recipe's layout (:mod:`k3convert.serving`): a
    warning per problem through ``log``, or with ``output.strict_serving`` an error
    before any work."""
    lay = r.layout.layout()
    target = ServingTarget(tp=lay.tp, moe_ep=lay.moe_ep, device=r.output.serving_device,
                           strict=r.output.strict_serving)  # fmt: skip
    serving_report(target.check(prep.plan, ck.config), log=log, plan=prep.plan)


def _prepare(r: Recipe, ck, out: Path, force: bool, calib_dir: Path, group, ui, say):
    """The full quantization preparation of a recipe that needs data, every process
    together: the auto-keep scan on process 0 (its choice shared), calibration with each
    layer's GPTQ solves split over the processes
    (:func:`k3convert.calibrate.sequential.calibrate_sequential`)."""

    def log(line: str) -> None:
        ui.item(line.split(":")[0])
        if say is not ui.write:
            say(line)

    ui.stage("calibrate", total=resolve(ck.config, str(ck.root))[1].num_layers, unit="layer")

    bar = (lambda i: ui.bar.update(1)) if group.leader else None  # progress: a layer done
    return prepare_quantization(src=ck.root, recipe=r, journal=calib_dir, out=out, force=force,
                                log=log if group.leader else None, group=group,
                                on_layer=bar)  # fmt: skip


def _carry_list(ck, prep) -> list[tuple[str, Path | bytes]]:
    """config.json (the quantized one), the source's aux files, and calibration's
    routing counts when there are any (auto-keep's sensitivity report, which records
    its own timing, is written next to the report instead, outside the manifest)."""
    # files this run writes next to the manifest itself: a source's own (a quantize
    # output's sensitivity report, an earlier convert's report) are not carried over them
    ours = {REPORT, SIDECAR, "sensitivity.json"}
    if prep is None:
        return [(n, p) for n, p in carried_files(ck) if n not in ours]

    ours.add(fidelity.FILE)  # this run's loss report (written next to the manifest)
    cal = prep.calibrated
    routing = None
    if cal is not None and cal.routing_counts:
        doc = routing_counts_doc(cal)
        routing = (json.dumps(doc, indent=1) + "\n").encode()
        ours.add(ROUTING_COUNTS)  # this calibration's counts replace the source's
    cfg = (json.dumps(prep.output_config(), indent=2) + "\n").encode()
    carry: list[tuple[str, Path | bytes]] = [("config.json", cfg)]
    carry += [(p.name, p) for p in ck.aux_files if p.name not in ours]
    if routing is not None:
        carry.append((ROUTING_COUNTS, routing))
    return carry


def _verify_reference(r: Recipe, ck) -> str:
    v = r.verify
    if v.reference is None:
        return str(ck.root)
    if v.reference == "transformers":
        return v.reference
    open_checkpoint(v.reference)  # a bad reference fails before any work
    return v.reference


def _run_verify(r: Recipe, out: Path, ref: str) -> dict:
    v = r.verify
    return run_verify(
        candidate=out,
        reference=ref,
        data=v.data,
        random=v.samples,
        seq_len=v.seq_len,
        pixel_values=v.pixel_values,
        decode=v.decode,
        kv_cache=v.kv_cache,
        max_kld=v.max_kld,
        min_top1=v.min_top1,
        max_rel_err=v.max_rel_err,
        dtype=v.dtype,
        progress=False,
        distributed=False,
    )


def _quantize_summary(prep, run: bool = True) -> dict:
    """The quantize section of the report; ``run``: with this run's own counts (not
    kept in the sidecar, which must not depend on how the stream was made)."""
    pl = prep.plan
    cal = prep.calibrated
    out = {
        "tensors": len(pl.rows),
        "quantized": len(pl.quantized),
        "quantized_bytes": pl.totals()[1],
        "schemes": sorted(pl.schemes()),
        "calibration": prep.provenance,
    }
    if run:
        # layers a rerun took from the calibration journal instead of recomputing
        out["calibration_layers_resumed"] = getattr(cal, "resumed_from", None)
        # calibrated weights (GPTQ solves, smoothed weights) each process produced
        out["calibrated_rows_per_process"] = getattr(cal, "solves_per_process", None)
    return out


def _read_losses(out: Path):
    """The loss report a conversion left in ``out`` (None: none, or not readable as one)."""

    try:
        return fidelity.LossReport.from_json(json.loads((out / fidelity.FILE).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _fidelity_summary(losses) -> dict | None:
    """report.json's view of the loss report: the totals, the summary line and the ten
    worst tensors (every tensor is in OUT/transcode_report.json)."""
    if losses is None or not (len(losses) or losses.unmeasured):
        return None

    doc = losses.to_json()
    doc.pop("entries")
    doc["summary"] = losses.summary()
    doc["file"] = fidelity.FILE
    doc["worst"] = [e.to_json() for e in losses.worst(10)]
    return doc


def _report(r, ck, out, prep, plan, res, times, vrep, group, inter, done=None,
            losses=None) -> dict:  # fmt: skip
    src_bytes = sum(f.size for f in ck.files())
    if done is not None:  # a complete stream verified again: its run's own figures
        q = done.get("quantize")
    else:
        q = _quantize_summary(prep) if prep is not None else None
    rep: dict = {
        "format": REPORT_FORMAT,
        "generator": f"k3convert {__version__}",
        "recipe": r.origin,
        "description": r.description,
        "source": str(Path(ck.root).resolve()),
        "out": str(out.resolve()),
        "model_type": ck.config.get("model_type"),
        "layout": {
            **plan.layout.to_json(),
            "world": plan.layout.world,
            "redundant_experts": r.layout.redundant_experts,
        },
        "processes": group.world,
        "sizes": {
            "source_bytes": src_bytes,
            "quantized_bytes": q.pop("quantized_bytes", None) if q else None,
            "stream_bytes": res.bytes_written,
            "units": len(plan.units),
        },
        "units": {"written": res.units_written, "skipped": res.units_skipped},
        "seconds": {k: round(v, 3) for k, v in times.items()},
        "intermediate": str(inter) if inter is not None else None,
        "quantize": q,
        "fidelity": _fidelity_summary(losses),
    }
    if vrep is not None:
        rep["verify"] = _verify_summary(vrep)
        rep["passed"] = bool(vrep.get("passed"))
    else:
        rep["verify"] = None
        rep["passed"] = None
    return rep


def _verify_summary(v: dict) -> dict:
    keep = ("passed", "failure", "thresholds", "logits", "decode", "candidate_kind",
            "reference_kind", "seconds", "inputs")  # fmt: skip
    return {k: v[k] for k in keep if k in v}


def render_summary(rep: dict) -> str:
    """The end-of-run table: sizes in and out, time per stage, verify's parity figures."""

    s = rep["sizes"]
    lay = rep["layout"]
    lines = [
        f"convert {rep['source']} -> {rep['out']}  (recipe {rep['recipe']})",
        f"  layout      tp={lay['tp']} pp={lay['pp']} moe_tp={lay['moe_tp']} "
        f"moe_ep={lay['moe_ep']} redundant_experts={lay['redundant_experts']}  "
        f"({lay['world']} ranks, {rep['processes']} process(es))",
        f"  size        source {human_bytes(s['source_bytes'])}"
        + (f" -> quantized {human_bytes(s['quantized_bytes'])}" if s["quantized_bytes"] else "")
        + f" -> stream {human_bytes(s['stream_bytes'])} in {s['units']} units "
        f"({rep['units']['written']} written, {rep['units']['skipped']} already done)",
    ]
    if rep.get("quantize"):
        q = rep["quantize"]
        cal = q.get("calibration") or {}
        lines.append(
            f"  quantize    {q['quantized']} of {q['tensors']} tensors "
            f"({', '.join(q['schemes']) or 'none'})"
            + (f", calibrated ({cal.get('algorithm')})" if cal else "")
        )
    if rep.get("fidelity"):
        lines.append(f"  fidelity    {rep['fidelity']['summary']}")
    secs = rep["seconds"]
    lines.append("  time        " + "  ".join(f"{k} {v:.1f} s" for k, v in secs.items()))
    v = rep.get("verify")
    if v:
        lg = v.get("logits") or {}
        th = v.get("thresholds") or {}
        kld = lg.get("kld") or {}

        def f(x, spec=".3g"):
            return "-" if x is None else format(x, spec)

        lines.append(
            f"  verify      {'PASS' if v.get('passed') else 'FAIL'}: KLD mean "
            f"{f(kld.get('mean'))} (max {f(th.get('max_kld'))}), top-1 "
            f"{f(lg.get('top1'), '.3f')} (min {f(th.get('min_top1'))}), max rel err "
            f"{f(lg.get('max_rel_err'))}"
            + (
                f", decode {'ok' if v['decode'].get('passed') else 'FAIL'}"
                if v.get("decode")
                else ""
            )
            + (f"; {v['failure']}" if v.get("failure") else "")
        )
    else:
        lines.append("  verify      skipped (verify.enabled: false)")
    lines.append(f"  report      {rep['out']}/{REPORT}")
    return "\n".join(lines)


__all__ = ["ConvertResult", "PlannedCheckpoint", "convert", "render_summary"]


def check_against(r: Recipe, model) -> str:
    """Everything ``convert`` checks before any work, against ``model`` (a checkpoint):
    the quantization plan and every unit of the layout. Reads no weights; returns a
    one-line description of what would be written."""
    ck = open_checkpoint(model)
    mt = ck.config.get("model_type")
    if r.source.model_type is not None and mt != r.source.model_type:
        raise ConfigError(
            f"{r.origin}: source.model_type is '{r.source.model_type}' but {ck.root}/config.json "
            f"says '{mt}'; this recipe was written for another model."
        )
    data: Checkpoint = ck
    if r.quantize is not None:
        with _key_path(r, "quantize"):
            prep = prepare_quantization(src=ck.root, recipe=r, plan_only=True)
        _check_serving(r, prep, ck, None)
        data = PlannedCheckpoint(prep)
    lay = r.layout
    load = None if lay.expert_load in (None, CALIBRATION) else lay.expert_load
    if lay.expert_load == CALIBRATION:
        load = _even_load(data)
    with _key_path(r, "layout"):
        plan = build_plan(data, lay.layout(), compression=r.output.compression,
                          pp_layers=list(lay.pp_layers) or None, expert_load=load,
                          redundant_experts=lay.redundant_experts)  # fmt: skip
    total = sum(up.header()[2] for up in plan.units)
    serving = [w for w in (prep.plan.warnings if r.quantize is not None else ())
               if w.startswith("serving: ")]  # fmt: skip
    return (
        f"{ck.root}: {len(plan.units)} units over {plan.layout.world} ranks, "
        f"{total / 2**20:.1f} MiB before compression"
    ) + "".join(f"\n# warning: {w}" for w in serving)  # recipe check prints it as comments
