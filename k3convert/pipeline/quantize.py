"""``quantize``: a checkpoint into a compressed-tensors directory, resolved once (recipe,
plan, auto-keep, calibration), then written by :mod:`k3convert.quant.writer`.

Everything that can be checked is checked before the first byte (scheme names, group
divisibility, static activation scales, OUT, free disk). The output is written to a
hidden ``.OUT.partial-PID`` directory and renamed at the end, so OUT either does not
exist or is complete; a failure while writing removes the partial output."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibrate.data import build_calibration_set
from ..calibrate.options import SequentialOptions
from ..calibrate.sensitivity import auto_keep as budgeted_keep
from ..calibrate.sensitivity import parse_budget
from ..calibrate.sequential import calibrate_sequential, check_algorithm
from ..checkpoint.output import check_output, guard_out, staged_output, write_error
from ..errors import ConfigError, OutputError
from ..parallel import procs
from ..parallel.procs import ProcessGroup
from ..quant import fidelity, planning
from ..quant.kvcache import kv_scale_tensors
from ..quant.rules import Plan
from ..quant.schemes import NonFiniteWeightError
from ..quant.writer import (
    DEFAULT_SHARD_SIZE,
    default_workers,
    mark_actorder,
    output_config,
    shared_amax,
    write_shards,
)
from ..recipe import load_recipe
from ..serving import report as serving_report
from ..shard.plan import ROUTING_COUNTS
from ..units import human_bytes


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
    #: what re-encoding the release did to its values (:class:`k3convert.quant.fidelity.LossReport`)
    fidelity: fidelity.LossReport | None = None

    def table(self, collapse: bool = True) -> str:
        return self.plan.table(collapse)

    def summary(self) -> str:
        before, after = self.plan.totals()
        n = len(self.plan.quantized)
        what = "would write" if self.dry_run else f"wrote {self.out}:"

        rate = f", {human_bytes(before / self.seconds)}/s" if self.seconds > 0 else ""
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

    calibrate: a :class:`k3convert.calibrate.options.SequentialOptions` runs
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
    does not search: no tokens, per-channel schemes; :mod:`k3convert.quant.mse_observer`),
    ``minmax`` the full range; None: the schemes' own (a recipe rule can set ``observer: mse`` in
    its options).
    """
    t0 = time.perf_counter()
    if workers is None:
        workers = default_workers()
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    out = Path(out)

    group = procs.current()

    job = QuantizeJob.resolve(
        scheme=scheme, recipe=recipe, keep=keep, default_keep=default_keep,
        kept_as_stored=kept_as_stored, input_scales=input_scales, calibrate=calibrate,
        algorithm=algorithm, auto_keep=auto_keep, auto_keep_scheme=auto_keep_scheme,
        sensitivity=sensitivity, plot=plot, sensitivity_data=sensitivity_data,
        serving=serving, weight_observer=weight_observer,
    )  # fmt: skip
    p = prepare_quantization(
        src=src, job=job, log=log if group.leader else None, workers=workers,
        dry_run=dry_run, journal=None, out=out, force=force, group=group,
        check_out=lambda need, root: check_output(out, force=force, need_bytes=need,
                                                  source=root),
    )  # fmt: skip
    plan, sens, sel = p.plan, p.sensitivity, p.selection
    if p.serving and group.leader:
        serving_report(p.serving, log=None if dry_run else log, plan=plan)  # dry run: in the table
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
        nfiles, p.fidelity = write_shards(ckpt, plan, tmp, shard_size, workers, progress,
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
    calibration's result and the values the writer needs (the fused sets' shared scales
    are computed as the writer reaches them; a damaged MXFP4 member is refused here)."""

    ckpt: object
    plan: Plan
    input_scales: dict
    shared: object  # quant.writer.SharedScales (name -> the fused set's shared scale)
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
        cfg = output_config(self.ckpt.config, self.plan, Path(self.ckpt.root),
                             self.provenance, self.kv_tensors)  # fmt: skip
        mark_actorder(cfg, self.plan, self.calibrated, self.provenance)
        if self.selection is not None:
            cfg["k3convert"]["auto_keep"] = self.selection.to_json()
        return cfg


@dataclass(frozen=True)
class QuantizeJob:
    """What a quantization does, resolved once from a recipe and / or keyword options
    (:meth:`resolve`): the rules (a default ``scheme`` or a ``recipe``'s), the keeps, the
    calibration (``calibrate``: :class:`k3convert.calibrate.options.SequentialOptions`,
    with its ``algorithm``), the budgeted exceptions (``auto_keep`` ...), the serving
    target and the weight observer; see :func:`quantize` for each field."""

    scheme: str | None = None
    recipe: object | None = None
    keep: tuple[str, ...] = ()
    default_keep: bool = True
    kept_as_stored: bool = True
    input_scales: Mapping | None = None
    calibrate: object | None = None
    algorithm: str = "rtn"
    auto_keep: str | None = None
    auto_keep_scheme: str | None = None
    sensitivity: str = "layer"
    plot: str | os.PathLike | None = None
    sensitivity_data: object | None = None
    serving: object | None = None
    weight_observer: str | None = None

    @classmethod
    def resolve(cls, *, recipe=None, **options) -> QuantizeJob:
        """The job of ``options`` (the fields above) over a recipe (a path or a loaded
        :class:`k3convert.recipe.Recipe`): its ``quantize.calibrate`` and ``auto_keep``
        sections apply unless the options give calibration / auto-keep themselves."""
        if (options.get("scheme") is None) == (recipe is None):
            raise ConfigError("give exactly one of --scheme NAME or --recipe R.yaml.")
        if isinstance(recipe, (str, os.PathLike)):
            recipe = load_recipe(recipe)
        if recipe is not None:
            q = recipe.require_quantize()
            if options.get("calibrate") is None and q.calibrate is not None:
                options["calibrate"] = q.calibrate.options()  # the recipe's calibration
                options["algorithm"] = q.calibrate.algorithm
            if options.get("auto_keep") is None and q.auto_keep is not None:
                ak = q.auto_keep
                options.update(auto_keep=ak.budget, auto_keep_scheme=ak.scheme,
                               sensitivity=ak.sensitivity, plot=ak.plot)  # fmt: skip
        options["keep"] = tuple(options.get("keep") or ())
        return cls(recipe=recipe, **options)


def prepare_quantization(
    *,
    src,
    job: QuantizeJob | None = None,
    log=None,
    workers: int = 1,
    dry_run: bool = False,
    check_out=None,
    journal: Path | None = None,
    out: Path | None = None,
    force: bool = False,
    plan_only: bool = False,
    group=None,
    on_layer=None,
    **options,
) -> Prepared:
    """:func:`quantize` up to its first output byte: the plan, the auto-keep scan, the
    calibration and the fused global scales, for ``job`` (or a job resolved from
    ``options``: :meth:`QuantizeJob.resolve`). check_out(need_bytes): checks OUT before
    hours of scanning / calibrating; journal: the calibration journal (default
    ``OUT.calib/``); plan_only: stop after the plan and every check that needs no data
    (``convert`` validates a recipe this way before any work). group: the torchrun job
    (every process calls this): the sensitivity scan runs on process 0 and its choice is
    shared; calibration runs on every process together
    (:func:`k3convert.calibrate.sequential.calibrate_sequential`). The job's serving
    target is checked before any scan or calibration (``Prepared.serving`` holds the
    problems; strict raises). on_layer(i): progress, called as calibration finishes
    layer ``i``."""
    if job is None:
        job = QuantizeJob.resolve(**options)
    elif options:
        raise TypeError(f"give a job or its options, not both: {sorted(options)}")
    group = group if group is not None else ProcessGroup()
    calibrate, algorithm, auto_keep, plot = job.calibrate, job.algorithm, job.auto_keep, job.plot
    ckpt, plan = plan_quantization(
        src=src, scheme=job.scheme, recipe=job.recipe, keep=job.keep,
        default_keep=job.default_keep, kept_as_stored=job.kept_as_stored,
        weight_observer=job.weight_observer,
    )  # fmt: skip
    input_scales = dict(job.input_scales or {})
    if calibrate is None and algorithm != "rtn":
        raise ConfigError(f"algorithm '{algorithm}' needs calibration (pass calibrate=...).")
    if calibrate is not None:
        calibrate.check()
        check_algorithm(plan, algorithm)
        _check_source_kv(ckpt, plan, calibrate)
    _check_auto_keep(auto_keep, plot, ckpt.root)
    _check_input_scales(plan, input_scales, calibrate)
    prepared = Prepared(ckpt, plan, input_scales, {}, plot=plot)
    if job.serving is not None:
        prepared.serving = job.serving.check(plan, ckpt.config)  # strict: raises here
    if plan_only:
        return prepared
    sens = sel = scan_set = None
    if auto_keep is not None:
        if not dry_run and check_out is not None:  # before the scan, not after it
            check_out(plan.totals()[1], ckpt.root)

        def scan():
            return _auto_keep(ckpt, plan, auto_keep, job.auto_keep_scheme, job.sensitivity,
                              job.sensitivity_data or calibrate, log)  # fmt: skip

        plan, sens, sel, scan_set = _on_leader(group, scan, "the sensitivity scan")
        if calibrate is not None:
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
        reuse = scan_set if job.sensitivity_data is None else None
        calibrated = _calibrate(ckpt, plan, out, force, calibrate, algorithm, log, reuse,
                                journal=journal, group=group, on_layer=on_layer)  # fmt: skip
        prepared.calibrated = calibrated
        prepared.input_scales = {**calibrated.input_scales, **input_scales}
        if calibrate.kv_cache:
            prepared.kv_tensors = kv_scale_tensors(calibrated.kv_absmax, ckpt.config)
        prepared.provenance = _provenance(calibrated, calibrate, algorithm)
    fuse_scales(prepared, workers)
    return prepared


def _check_auto_keep(auto_keep, plot, root) -> None:
    """The auto-keep budget and the chart's path, before any work."""
    if plot is not None and auto_keep is None:
        raise ConfigError("plot is the sensitivity chart of auto_keep; give auto_keep too.")
    if auto_keep is not None and plot is not None:
        guard_out(plot, [root])
        parent = Path(plot).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise OutputError(
                f"{plot}: the chart's directory {parent} does not exist or is not "
                f"writable; create it or choose another --plot path."
            )
    if auto_keep is not None:
        parse_budget(auto_keep)


def _provenance(calibrated, calibrate, algorithm: str) -> dict:
    """config.json's ``k3convert.calibration``: what calibrated the checkpoint."""
    provenance = {
        "algorithm": algorithm,
        "dataset": calibrated.calibration,
        "options": calibrate.algorithm_options(algorithm),
        "rtn_fallbacks": list(calibrated.fallbacks),
    }
    if calibrated.smoothing:
        provenance["smoothed_mappings"] = sum(v is not None for v in calibrated.smoothing.values())
        provenance["mappings"] = len(calibrated.smoothing)
    return provenance


def fuse_scales(prepared: Prepared, workers: int = 1) -> None:
    """The last step of a preparation: the fused NVFP4 sets' shared largest |value|,
    computed as the writer reaches each set (:class:`k3convert.quant.writer.SharedScales`;
    nothing for other schemes). A ``plan_only`` preparation that needs no calibration is
    complete after it (``convert`` uses it so)."""
    del workers  # the writer's workers compute the sets they reach
    prepared.shared = shared_amax(prepared.ckpt, prepared.plan)
    try:
        prepared.shared.check_release()
    except NonFiniteWeightError as e:  # the scheme names the tensor; add the checkpoint
        raise NonFiniteWeightError(f"{prepared.ckpt.root}: {e}") from None


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


class CalibrationShortfallWarning(UserWarning):
    """The calibration data ran out before the number of samples asked for."""


def _say_shortfall(calib, log) -> None:
    """Fewer calibration samples than asked for (the data ran out): said where the user
    looks (``log``, else a warning, which the CLI prints), not only in config.json's
    provenance."""
    asked = calib.options.get("num_samples")
    if not asked or calib.num_samples >= asked:
        return
    text = (
        f"calibration: {calib.num_samples} of the {asked} requested samples "
        f"({int(calib.attention_mask.sum())} tokens in all): {calib.source} ran out; add "
        f"data or ask for fewer (--num-samples, or quantize.calibrate.num_samples)."
    )
    if log is not None:
        log(f"warning: {text}")
    else:
        warnings.warn(text, CalibrationShortfallWarning, stacklevel=3)


def _auto_keep(ckpt, plan: Plan, budget, ladder, method: str, opts, log):
    """The sensitivity scan on the calibration set and the budgeted selection applied:
    (new plan, report, selection, the calibration set). The budget and the ladder are
    checked first."""

    b = parse_budget(budget)
    opts = opts if opts is not None else SequentialOptions()
    calib = build_calibration_set(
        ckpt.root, opts.dataset, num_samples=opts.num_samples, seq_len=opts.seq_len,
        seed=opts.seed, packing=opts.packing,
    )  # fmt: skip
    _say_shortfall(calib, log)
    new_plan, report, sel = budgeted_keep(ckpt, plan, calib, b, ladder=ladder, method=method,
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
    journal: Path | None = None, group=None, on_layer=None,
):  # fmt: skip
    """Build the calibration set and run layer-sequential calibration (before anything
    is written: a bad dataset or an existing OUT fails first). journal: given by a caller
    that owns OUT's resumption (convert); default ``OUT.calib/`` next to a new OUT."""

    if journal is None and out.exists() and not force:
        raise OutputError(f"{out} already exists; choose another OUT or pass --force.")
    if calib is None:  # (else: the set the sensitivity scan built from the same options)
        calib = build_calibration_set(
            ckpt.root, opts.dataset, num_samples=opts.num_samples, seq_len=opts.seq_len,
            seed=opts.seed, packing=opts.packing,
        )  # fmt: skip
        if group is None or group.leader:  # said once, by the process that reports
            _say_shortfall(calib, log)
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
            on_layer=on_layer,
        )
    except OSError as e:  # disk full or read-only while writing the journal / spill
        raise write_error(e, journal, "writing the calibration journal") from e


def plan_quantization(*, src, scheme: str | None = None, recipe=None, **kw):
    """:func:`k3convert.quant.planning.plan_quantization` with ``recipe`` also a path."""
    if (scheme is None) == (recipe is None):  # before a bad recipe path, as that does
        raise ConfigError("give exactly one of --scheme NAME or --recipe R.yaml.")
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe)
    return planning.plan_quantization(src=src, scheme=scheme, recipe=recipe, **kw)
