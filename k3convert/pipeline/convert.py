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
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import targets
from ..arch import resolve, validate_source
from ..checkpoint import Checkpoint, open_checkpoint
from ..checkpoint.bounded import read_json
from ..checkpoint.output import check_output, guard_out, reports_write_errors
from ..checkpoint.tokenizer_files import check_engine_json
from ..errors import ConfigError, K3Error, OutputError
from ..parallel import procs
from ..quant import fidelity
from ..quant.writer import re_encodes, torch_threads
from ..recipe import CALIBRATION, Recipe, apply_overrides, load_recipe, parse_recipe, recipe_to_dict
from ..recipe.checks import check_model_type
from ..report_html import write_html
from ..serving import ServingTarget, resolve_device
from ..serving import report as serving_report
from ..shard.plan import ROUTING_COUNTS, build_plan
from ..shard.writer import ShardResult, carried_files, write_stream
from ..stream.format import JOURNAL, MANIFEST
from ..stream.reader import load_manifest
from ..units import byte_bar
from ..verify.report import write_json
from ..verify.run import run_verify
from .convert_report import REPORT, build_report, quantize_summary, read_losses, render_summary
from .planned import DEFAULT_CACHE_BYTES, PlannedCheckpoint
from .quantize import (
    Prepared,
    fuse_scales,
    prepare_quantization,
    routing_counts_doc,
    write_checkpoint,
)


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
        t = targets.TARGETS.get(self.report.get("format"))
        if t is not None and t.summary_fn is not None:
            return t.render(self.report)
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
        "files": ck.file_stamps(),
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
            side = read_json(out / SIDECAR, "report", OutputError)
            same = side.get("identity") == _stream_identity(r, ck)
        except (OutputError, AttributeError):
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


def data_fingerprint(prepared, data_config: dict) -> str:
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
        self.bar = byte_bar(total=0, disable=not enabled, smoothing=0.1, desc="convert")

    def stage(self, name: str, total: float = 0, unit: str = "B") -> None:
        i = self.stages.index(name) + 1
        self.bar.unit = unit
        self.bar.reset(total=total)
        self.bar.set_postfix_str("", refresh=False)
        self.bar.set_description(f"convert [{i}/{len(self.stages)} {name}]", refresh=True)

    def item(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def write(self, line: str) -> None:
        if self.bar.disable and not line.startswith("warning: "):
            return  # --no-progress: quiet, but a warning is still said
        self.bar.write(line, file=sys.stderr)

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
    out = Path(out)
    target = targets.get(r.output.format, f"{r.origin}: output.format")
    if target.convert_fn is not None:  # an engine's files: the target's own job
        rep, written, kept, vrep = target.convert(
            r, src=src, out=out, force=force, progress=progress, report_html=report_html,
            verify=lambda o, ref: _run_verify(r, o, ref), keep_intermediate=keep_intermediate,
            log=log or (lambda m: print(m, file=sys.stderr)),
        )  # fmt: skip
        return ConvertResult(out, rep, rep["passed"], rep["seconds"]["total"], written, kept,
                             vrep)  # fmt: skip
    group = procs.current()
    ck, calib_dir, inter, done = _open(r, src, out, keep_intermediate, force, report_html)
    stages = [*(["calibrate"] if needs_data(r) else []), "write",
              *(["verify"] if r.verify.enabled else [])]  # fmt: skip
    ui = _Display(progress and group.leader, stages)
    say = log or ui.write
    try:
        # -- 1. plan: every check that needs no tensor data ---------------------------
        t = time.perf_counter()
        st = _plan(r, ck, cache_bytes, say if group.leader else None)
        vref = _verify_reference(r, ck)
        times["plan"] = time.perf_counter() - t

        # -- 2. calibrate (and the auto-keep scan) -------------------------------------
        if done is not None:  # a complete stream of this recipe: verify it again
            ui.stages = [s for s in stages if s != "calibrate"]
        elif r.quantize is not None:
            took = _calibrate(st, r, ck, out, force, calib_dir, group, ui, say, cache_bytes)
            if took is not None:
                times["calibrate"] = took
        # (else the plan of step 1 is the one to write: for a complete OUT with
        # expert_load: calibration, its even counts; the manifest holds the real placement)

        # -- 3. write the stream ------------------------------------------------------
        t = time.perf_counter()
        ui.stage("write")
        if done is not None:
            say(f"{out}: already a complete stream of this recipe and source; verifying it")
        res = _write(st, r, ck, out, force, progress, done, group, ui)
        times["write"] = time.perf_counter() - t

        losses = loss_report(st.data, st.prep, group, unmeasured=done is None)
        st.data = None  # its per-tensor caches are not needed by verify or the report
        vrep = report = err = None
        if group.leader:  # the rest is process 0's; the others wait for its verdict
            try:
                report, vrep = _finish(r, ck, out, st, res, times, t_start, done, inter,
                                       force, vref, report_html, group, ui,
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


def _open(r: Recipe, src, out: Path, keep_intermediate: bool, force: bool, report_html):
    """The source opened and every output path checked before any work: (checkpoint,
    the calibration journal's directory, the intermediate checkpoint's path or None, the
    sidecar of a complete OUT this recipe already wrote or None)."""
    src = src if src is not None else r.source.path
    if src is None:
        raise ConfigError(
            f"{r.origin}: no source: give SRC on the command line or source.path in the recipe."
        )
    ck = open_checkpoint(src)
    guard_out(out, [ck.root])
    calib_dir = out.parent / f"{out.name}.calib"
    guard_out(calib_dir, [ck.root, out])
    inter = intermediate(r, out, ck) if keep_intermediate else None
    if report_html is not None:
        _check_file_out(report_html, "HTML report", [ck.root, out])
    check_model_type(r, ck.config, ck.root)
    done = _check_out_early(out, force, r, ck)
    if done is not None and inter is not None:
        raise OutputError(
            f"{out}: already a complete stream of this recipe; --keep-intermediate would "
            f"need the quantization (and calibration) again - pass --force to redo the "
            f"conversion, or run `k3convert quantize` for the checkpoint."
        )
    if inter is not None:
        check_output(inter, force=force, need_bytes=0, source=ck.root)
    return ck, calib_dir, inter, done


@dataclass
class _Planned:
    """Step 1's result, updated by calibration: the quantization's preparation (None
    without a quantize section), the checkpoint the stream is cut from, the unit plan
    and what it was placed with."""

    prep: Prepared | None
    data: Checkpoint
    plan: object
    layout: object
    placement: dict
    load: object
    #: layout.expert_load: calibration (the counts come after calibration)
    pending: bool


def _plan(r: Recipe, ck, cache_bytes: int, log) -> _Planned:
    """Step 1: the quantization plan (plan only: no data) and every unit of the layout,
    with the expert load known now (even counts for ``calibration``)."""
    lay = r.layout
    placement = dict(
        compression=r.output.compression,
        pp_layers=list(lay.pp_layers) or None,
        redundant_experts=lay.redundant_experts,
    )
    load = None if lay.expert_load in (None, CALIBRATION) else lay.expert_load
    prep = None
    pending = lay.expert_load == CALIBRATION
    layout = lay.layout()
    if r.quantize is not None:
        with _key_path(r, "quantize"):
            prep = prepare_quantization(src=ck, recipe=r, plan_only=True)
        data: Checkpoint = PlannedCheckpoint(prep, cache_bytes)
    else:
        data = ck
    with _key_path(r, "layout"):  # raises on a layout the model cannot take
        plan = build_plan(data, layout, expert_load=_even_load(data) if pending else load,
                          **placement)  # fmt: skip
    if prep is not None:  # after the layout's own error, which says the same thing first
        _check_serving(r, prep, ck, log)
    return _Planned(prep, data, plan, layout, placement, load, pending)


def _calibrate(st: _Planned, r: Recipe, ck, out, force, calib_dir, group, ui, say,
               cache_bytes) -> float | None:  # fmt: skip
    """Step 2: the preparation completed (calibration and the auto-keep scan where the
    recipe asks, the fused scales otherwise) and, when data changed the checkpoint, the
    units planned again (with calibration's routing counts for ``expert_load``). Returns
    the seconds calibration took (None when nothing needed data)."""
    if not needs_data(r):
        fuse_scales(st.prep)  # the plan-only preparation is complete: no data needed
        return None
    t = time.perf_counter()
    st.prep = st.data = st.plan = None  # the plan-only preparation's: planned again below
    st.prep = _prepare(r, ck, out, force, calib_dir, group, ui, say)
    st.data = PlannedCheckpoint(st.prep, cache_bytes)
    took = time.perf_counter() - t  # the re-plan below is not calibration's time
    if st.pending:
        cal = st.prep.calibrated
        counts = cal.routing_counts if cal is not None else {}
        if not counts:
            raise ConfigError(
                f"{r.origin}: layout.expert_load is 'calibration' but calibration "
                f"routed no tokens (the model has no MoE layer the runtime calibrates)."
            )
        st.load = counts
    st.plan = build_plan(st.data, st.layout, expert_load=st.load, **st.placement)
    return took


def _write(st: _Planned, r: Recipe, ck, out, force, progress, done, group, ui) -> ShardResult:
    """Step 3: the units (and carried files) of the stream, or a complete OUT's result."""
    carry = carry_list(ck, st.prep)
    identity = data_fingerprint(st.prep, st.data.config)
    workers = r.output.workers or procs.cores_per_process()
    # units are written (and their tensors quantized) on `workers` threads, one core
    # each: nested OpenMP teams would oversubscribe the cores
    with torch_threads(1 if workers > 1 else torch.get_num_threads()):
        if done is not None:
            return _from_manifest(out)
        return write_stream(
            data=st.data, plan=st.plan, out=out, source=ck, carry=carry,
            compress=r.output.compression, workers=workers, force=force,
            progress=progress, recipe=recipe_to_dict(r), unit_hash=r.output.unit_hash,
            identity=identity, bar=ui.bar, group=group, share_by_layer=True,
            on_unit=lambda up: ui.item(f"rank {up.rank} {up.name}"),
        )  # fmt: skip


def _finish(r, ck, out, st: _Planned, res, times, t_start, done, inter, force, vref,
            report_html, group, ui, losses=None):  # fmt: skip
    """Process 0, after the stream is committed: the sidecar, the loss report, the
    intermediate checkpoint (before the calibration journal it reads is removed), verify,
    the report files. The quantization's preparation (``st.prep``, per-tensor rows and
    calibration results) is summarised and let go before verify runs."""
    prep, plan = st.prep, st.plan
    if done is None and losses is not None and (len(losses) or losses.unmeasured):
        losses.write(out / fidelity.FILE)
    elif done is not None:  # verified again: the report its run wrote, if any
        losses = read_losses(out)
    if done is None:
        side = {"identity": _stream_identity(r, ck), "quantize": None}
        if prep is not None:
            side["quantize"] = quantize_summary(prep, run=False)
        (out / SIDECAR).write_text(json.dumps(side, indent=1) + "\n")
    if inter is not None and prep is not None:
        write_checkpoint(prep, inter, force=force, progress=False)
    if prep is not None and prep.calibrated is not None:
        prep.calibrated.cleanup()
    if prep is not None and prep.sensitivity is not None and done is None:
        prep.sensitivity.write(out / "sensitivity.json")
        if prep.plot is not None:
            prep.sensitivity.plot(prep.plot)
    q = None
    if done is None and prep is not None:
        q = quantize_summary(prep)
    st.prep = prep = None
    plan.drop_records()  # (they hold the planned checkpoint, the preparation, its cache)
    vrep = None
    if r.verify.enabled:
        t = time.perf_counter()
        ui.stage("verify", total=1, unit="run")
        # short: a long postfix squeezes the bar to nothing on an 80-column terminal
        ui.item("vs " + ("transformers" if vref == "transformers" else Path(vref).name)[:24])
        vrep = _run_verify(r, out, vref, ck)
        ui.bar.update(1)
        times["verify"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t_start
    report = build_report(r, ck, out, q, plan, res, times, vrep, group, inter, done, losses)

    write_json(report, out / REPORT)
    if report_html is not None:
        write_html(report, vrep, report_html, experts=plan.experts)
    return report, vrep


@contextmanager
def _key_path(r: Recipe, section: str):
    """A model-dependent check of a recipe section fails naming the section (and the
    recipe) first: ``R.yaml: layout (tp=3 pp=1 moe_tp=3 moe_ep=1): cannot split ...``;
    an error that already names its place in the recipe (``K3Error.where``, e.g. a
    rule's ``R.yaml: quantize.rules[1]``) is left as it is."""
    try:
        yield
    except K3Error as e:
        if e.where is not None:
            raise
        where = section
        if section == "layout":
            lay = r.layout.layout()
            where = f"layout (tp={lay.tp} pp={lay.pp} moe_tp={lay.moe_tp} moe_ep={lay.moe_ep})"
        msg = str(e)
        try:
            err = type(e)(f"{r.origin}: {where}: {msg}")
        except TypeError:  # an error class with its own constructor
            err = ConfigError(f"{r.origin}: {where}: {msg}")
        err.exit_code = e.exit_code
        err.where = where
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


def loss_report(data, prep, group, *, unmeasured: bool) -> fidelity.LossReport:
    """Every process's losses against the release (:mod:`k3convert.quant.fidelity`), as
    measured by the planned checkpoint ``data`` while it produced its rows; with
    ``unmeasured``, the re-encoded rows none produced are listed as such (a resumed run
    produces only what it writes)."""
    mine = list(data.losses.values()) if isinstance(data, PlannedCheckpoint) else []
    got = {e.name: e for part in group.gather(mine) for e in part}
    todo = [] if prep is None or not unmeasured else [
        r.name for r in prep.plan.rows if re_encodes(r) and r.name not in got
    ]  # fmt: skip
    return fidelity.LossReport(got.values(), todo)


def intermediate(r: Recipe, out: Path, ck) -> Path:
    """``OUT.quantized`` for ``--keep-intermediate``: guarded against the source and OUT,
    refused for a recipe that quantizes nothing."""
    inter = guard_out(out.parent / f"{out.name}.quantized", [ck.root, out])
    if r.quantize is None:
        raise ConfigError(
            f"{r.origin}: --keep-intermediate keeps the quantized checkpoint, but the "
            f"recipe has no quantize section (nothing is quantized)."
        )
    return inter


def needs_data(r: Recipe) -> bool:
    q = r.quantize
    return q is not None and (q.calibrate is not None or q.auto_keep is not None)


def _check_serving(r: Recipe, prep, ck, log) -> list:
    """vLLM's load-time rules at the recipe's layout (:mod:`k3convert.serving`): a
    warning per problem through ``log``, or with ``output.strict_serving`` an error
    before any work. Returns the problems."""
    lay = r.layout.layout()
    engine = targets.get(r.output.format, "output.format").engine
    device = resolve_device(r.output.serving_device, engine_output=engine)
    target = ServingTarget(tp=lay.tp, moe_ep=lay.moe_ep, device=device,
                           strict=r.output.strict_serving)  # fmt: skip
    problems = target.check(prep.plan, ck.config)
    serving_report(problems, log=log, plan=prep.plan)
    return problems


def _prepare(r: Recipe, ck, out: Path, force: bool, calib_dir: Path, group, ui, say):
    """The full quantization preparation of a recipe that needs data, every process
    together: the auto-keep scan on process 0 (its choice shared), calibration with each
    layer's GPTQ solves split over the processes
    (:func:`k3convert.calibrate.sequential.calibrate_sequential`). The bar counts the
    layers calibration finishes (its ``on_layer`` events); the log lines go to ``say``
    (above the bar, or the caller's log)."""
    n = resolve(ck.config, str(ck.root))[1].num_layers
    ui.stage("calibrate", total=n, unit="layer")
    if r.quantize.auto_keep is not None:
        ui.item("auto-keep sensitivity scan")

    def layer_done(i: int) -> None:
        ui.item(f"layer {i} calibrated")
        ui.bar.update(1)

    log = say if group.leader else None  # (the bar's write, or the caller's log)
    return prepare_quantization(src=ck, recipe=r, journal=calib_dir, out=out, force=force,
                                log=log, group=group,
                                on_layer=layer_done if group.leader else None)  # fmt: skip


def carry_list(ck, prep) -> list[tuple[str, Path | bytes]]:
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
    aux = [p for p in ck.aux_files if p.name not in ours]
    check_engine_json(aux)
    carry += [(p.name, p) for p in aux]
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


def _run_verify(r: Recipe, out: Path, ref: str, ck=None) -> dict:
    """verify OUT against ``ref``; ``ck``: the source checkpoint, already open (used as
    the reference when ``ref`` is its directory: its tensor table is not read twice)."""
    v = r.verify
    return run_verify(
        candidate=out,
        reference=ref,
        reference_checkpoint=ck,
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


def check_against(r: Recipe, model) -> str:
    """Everything ``convert`` checks before any work, against ``model`` (a checkpoint):
    the quantization plan and every unit of the layout. Reads no weights; returns a
    one-line description of what would be written."""
    ck = open_checkpoint(model)
    check_model_type(r, ck.config, ck.root)
    data: Checkpoint = ck
    problems = []
    if r.quantize is not None:
        with _key_path(r, "quantize"):
            prep = prepare_quantization(src=ck, recipe=r, plan_only=True)
        problems = _check_serving(r, prep, ck, None)
        data = PlannedCheckpoint(prep)
    lay = r.layout
    load = None if lay.expert_load in (None, CALIBRATION) else lay.expert_load
    if lay.expert_load == CALIBRATION:
        load = _even_load(data)
    with _key_path(r, "layout"):
        plan = build_plan(data, lay.layout(), compression=r.output.compression,
                          pp_layers=list(lay.pp_layers) or None, expert_load=load,
                          redundant_experts=lay.redundant_experts)  # fmt: skip
    total = sum(up.nbytes for up in plan.units)
    serving = list(dict.fromkeys(f"serving: {p.line()}" for p in problems))
    return (
        f"{ck.root}: {len(plan.units)} units over {plan.layout.world} ranks, "
        f"{total / 2**20:.1f} MiB before compression"
    ) + "".join(f"\n# warning: {w}" for w in serving)  # recipe check prints it as comments


__all__ = ["ConvertResult", "PlannedCheckpoint", "check_against", "convert", "render_summary"]
