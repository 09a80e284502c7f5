"""``convert`` with ``output.format: vllm``: quantize (when the recipe has a quantize
section) and write vLLM's sharded_state files in one pass, then ``verify`` OUT against
the original.

No quantized checkpoint is written in between: the quantization plan becomes a
:class:`~.planned.PlannedCheckpoint` (calibrated first when the recipe asks, journaled
in ``OUT.calib/``), and the vLLM writer cuts each rank's parameters from it, each tensor
quantized when first read and dropped after its last reader. OUT carries that
checkpoint's tensor list (:data:`~k3convert.engines.vllm_sharded.DESCRIBED`), so
``verify OUT`` maps the rank files back without it. An interrupted run resumes as
``shard --target vllm`` does: rank files found complete, written from the same source
and the same quantization (the index's ``identity``), are kept. ``--keep-intermediate``
also writes the quantized checkpoint to ``OUT.quantized/``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import zstandard

from ..checkpoint import open_checkpoint
from ..checkpoint.output import check_output, guard_out
from ..engines.vllm_index import CONVERT_REPORT
from ..errors import ConfigError
from ..parallel import procs
from ..quant import fidelity
from ..recipe import Recipe
from ..recipe.checks import check_model_type
from ..recipe.sections import LayoutSection
from ..serving import ServingTarget, resolve_device, vllm_check
from ..serving import report as serving_report
from .convert import carry_list, data_fingerprint, intermediate, loss_report, needs_data
from .convert_report import fidelity_summary, quantize_line, quantize_summary
from .planned import PlannedCheckpoint
from .quantize import fuse_scales, prepare_quantization, write_checkpoint

#: what convert writes next to the sharded files
REPORT = CONVERT_REPORT  # (allowed unlisted in OUT by shard --check)


def _check(r: Recipe) -> int:
    """The layout as ``write_vllm`` takes it (ep), or the reason the recipe cannot."""
    lay, o, d = r.layout, r.output, LayoutSection()
    stream_only = [k for k in ("pp_layers", "expert_load", "redundant_experts")
                   if getattr(lay, k) != getattr(d, k)]  # fmt: skip
    if o.compression != "none":
        stream_only.append("output.compression")
    if stream_only:
        raise ConfigError(
            f"{r.origin}: output.format vllm writes vLLM's sharded_state files, which take "
            f"layout.tp / pp / moe_ep only; drop {', '.join(stream_only)} (stream options)."
        )
    if lay.moe_ep not in (1, lay.tp) or (lay.moe_tp not in (None, lay.tp // lay.moe_ep)):
        raise ConfigError(
            f"{r.origin}: output.format vllm: layout.moe_ep is 1 (experts split over tp) or "
            f"equal to layout.tp (vLLM's enable_expert_parallel), not {lay.moe_ep} of "
            f"tp {lay.tp}."
        )
    return lay.moe_ep


def _described(data: PlannedCheckpoint) -> bytes:
    """The planned checkpoint's tensor list as the index carries it (zstd JSON)."""
    doc = json.dumps(data.layout_doc(), separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=9).compress(doc)


def convert_vllm(r: Recipe, *, src, out: Path, force: bool, progress: bool, verify,
                 keep_intermediate: bool = False, log=print) -> dict:  # fmt: skip
    """Run the steps; returns the report (also written to OUT/convert_report.json).
    ``verify(out, reference)``: the verify run (convert's, with the recipe's inputs)."""
    from ..engines.vllm_write import write_vllm

    t0 = time.perf_counter()
    ep = _check(r)
    group = procs.current()
    if not group.leader:  # (process 0 says it)
        log = _quiet
    src = src if src is not None else r.source.path
    if src is None:
        raise ConfigError(f"{r.origin}: no source: give SRC or source.path in the recipe.")
    ck = open_checkpoint(src)
    check_model_type(r, ck.config, ck.root)
    out = guard_out(out, [ck.root])
    inter = intermediate(r, out, ck) if keep_intermediate else None
    if inter is not None:
        check_output(inter, force=force, need_bytes=0, source=ck.root)
    if r.quantize is not None and out.exists():
        # OUT refused now, not after hours of calibration (the writer checks again)
        check_output(out, force=force, need_bytes=0, source=ck.root)
    times: dict[str, float] = {}
    # vLLM on the recipe's serving device (auto: this machine's), before any byte is written
    device = resolve_device(r.output.serving_device, engine_output=True)
    serving = ServingTarget(tp=r.layout.tp, moe_ep=ep, device=device,
                            strict=r.output.strict_serving)  # fmt: skip
    data, prep, kw = ck, None, {}
    if r.quantize is not None:
        calib = guard_out(out.parent / f"{out.name}.calib", [ck.root, out])
        t = time.perf_counter()
        prep = prepare_quantization(src=ck, recipe=r, plan_only=True)
        serving_report(serving.check(prep.plan, ck.config, model=True), log=log, plan=prep.plan)
        if needs_data(r):
            prep = prepare_quantization(src=ck, recipe=r, journal=calib, out=out, force=force,
                                        log=log, group=group)  # fmt: skip
            times["calibrate"] = time.perf_counter() - t
        else:
            fuse_scales(prep)
        data = PlannedCheckpoint(prep)
        # the rank files are cut from the planned tensors as they are produced: no
        # quantized checkpoint on disk; what they depend on besides the source is bound
        kw = dict(origin=ck, identity=data_fingerprint(prep, data.config),
                  carry=carry_list(ck, prep), described=_described(data))  # fmt: skip
    t = time.perf_counter()
    lay = r.layout
    log(f"{'quantize + ' if prep else ''}shard --target vllm -> {out} (tp {lay.tp}, pp "
        f"{lay.pp}, ep {ep})")  # fmt: skip
    res = write_vllm(src=data, out=out, tp=lay.tp, pp=lay.pp, ep=ep, force=force,
                     progress=progress,
                     before_write=None if prep else vllm_check(serving, log), group=group,
                     **kw)  # fmt: skip
    times["write"] = time.perf_counter() - t
    losses = None
    if prep is not None:
        losses = loss_report(data, prep, group, unmeasured=res.files_resumed > 0)
        if group.leader and (len(losses) or losses.unmeasured):
            losses.write(out / fidelity.FILE)
        if inter is not None:
            write_checkpoint(prep, inter, force=force, progress=False, group=group)
        group.barrier()  # (every process done with the calibration journal)
        if prep.calibrated is not None and group.leader:
            prep.calibrated.cleanup()
    report = err = None
    if group.leader:  # verify and the report are process 0's; the others wait for them
        try:
            vrep = None
            if r.verify.enabled:
                t = time.perf_counter()
                ref = r.verify.reference or str(ck.root)
                log(f"verify {out} against {ref}")
                vrep = verify(out, ref)
                times["verify"] = time.perf_counter() - t
            times["total"] = time.perf_counter() - t0
            report = {
                "format": "vllm", "source": str(ck.root), "out": str(out), "recipe": r.origin,
                "quantized": str(inter) if inter is not None else None,
                "layout": {"tp": lay.tp, "pp": lay.pp, "ep": ep}, "rank_files": res.files,
                "rank_files_kept": res.files_resumed, "bytes": res.bytes_written,
                "seconds": times, "processes": group.world,
                "rank_files_per_process": res.per_process,
                "quantize": None if prep is None else quantize_summary(prep),
                "fidelity": fidelity_summary(losses),
                "verify": vrep, "passed": None if vrep is None else bool(vrep["passed"]),
            }  # fmt: skip
            (out / REPORT).write_text(json.dumps(report, indent=1, default=str) + "\n")
        except Exception as e:
            if group.world == 1:
                raise
            err = e
    group.agree(err, f"verifying {out}")
    return group.share(report)


def _quiet(_msg: str) -> None:
    pass


def convert_target(r: Recipe, *, src, out: Path, force: bool, progress: bool, report_html,
                   verify, log, keep_intermediate: bool = False,
                   ) -> tuple[dict, int, int, dict | None]:  # fmt: skip
    """``convert`` for ``output.format: vllm`` (:data:`k3convert.targets.TARGETS`): the
    report, the rank files written and kept from an interrupted run, verify's report."""
    if report_html is not None:
        raise ConfigError("--report-html describes a stream; output.format vllm has none.")
    rep = convert_vllm(r, src=src, out=out, force=force, progress=progress, verify=verify,
                       keep_intermediate=keep_intermediate, log=log)  # fmt: skip
    return rep, rep["rank_files"], rep["rank_files_kept"], rep["verify"]


def render_vllm_summary(rep: dict) -> str:
    lay, secs = rep["layout"], rep["seconds"]
    kept = rep["rank_files_kept"]
    lines = [
        f"convert {rep['source']} -> {rep['out']}  (recipe {rep['recipe']}, vLLM sharded_state)",
        f"  layout      tp={lay['tp']} pp={lay['pp']} ep={lay['ep']}: {rep['rank_files']} "
        f"rank file(s), {rep['bytes'] / 2**20:.1f} MiB"
        + (f" ({kept} kept from an interrupted run)" if kept else ""),
    ]
    if rep.get("quantize"):
        lines.append(quantize_line(rep["quantize"]))
    if rep.get("quantized"):
        lines.append(f"  quantized   {rep['quantized']} (--keep-intermediate)")
    if rep.get("fidelity"):
        lines.append(f"  fidelity    {rep['fidelity']['summary']}")
    lines.append("  time        " + "  ".join(f"{k} {v:.1f} s" for k, v in secs.items()))
    v = rep.get("verify")
    if v:
        # verify's own summary: figures next to their limits, the reference, the family
        from ..verify.summary import build_summary

        head, *rest = (v.get("summary") or build_summary(v))["lines"]
        lines.append(f"  verify      {head}")
        lines += [f"              {x}" for x in rest]
    from ..engines.vllm_index import llm_call

    lines.append(f"  load with   {llm_call(rep['out'])}")
    return "\n".join(lines)
