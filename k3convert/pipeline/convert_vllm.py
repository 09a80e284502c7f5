"""``convert`` with ``output.format: vllm``: quantize (when the recipe has a quantize
section) into ``OUT.quantized/``, write vLLM's sharded_state files from it into OUT
(``shard --target vllm``), then ``verify`` OUT against the original.

The quantized checkpoint is kept: it is what the sharded files were cut from, the
index names it, and ``verify OUT`` recomputes the mapping from its metadata. Both steps
resume as their commands do (a complete quantized checkpoint of the same recipe is
reused; rank files found complete in an interrupted write are kept).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..checkpoint import open_checkpoint
from ..checkpoint.bounded import read_json
from ..checkpoint.output import guard_out
from ..engines.vllm_index import CONVERT_REPORT
from ..errors import ConfigError
from ..parallel import procs
from ..recipe import Recipe, recipe_to_dict
from ..recipe.checks import check_model_type
from ..recipe.sections import LayoutSection
from ..serving import ServingTarget, resolve_device, vllm_check
from ..serving import report as serving_report

#: what convert writes next to the sharded files
REPORT = CONVERT_REPORT  # (allowed unlisted in OUT by shard --check)
#: in OUT.quantized: the recipe and source it was quantized with (a rerun reuses it)
SIDECAR = ".k3-convert-vllm.json"


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
    if procs.current().world > 1:
        raise ConfigError(
            f"{r.origin}: output.format vllm runs in one process; run it without torchrun."
        )
    return lay.moe_ep


def _identity(r: Recipe, ck) -> dict:
    """What the quantized checkpoint depends on: the source files and the quantize section."""
    doc = {"source": str(Path(ck.root).resolve()), "files": ck.file_stamps(),
           "quantize": recipe_to_dict(r)["quantize"]}  # fmt: skip
    return json.loads(json.dumps(doc))


def _made_by(inter: Path) -> dict | None:
    try:
        return read_json(inter / SIDECAR, "report", ConfigError)
    except ConfigError:
        return None


def convert_vllm(r: Recipe, *, src, out: Path, force: bool, progress: bool, verify,
                 log=print) -> dict:  # fmt: skip
    """Run the three steps; returns the report (also written to OUT/convert_report.json).
    ``verify(out, reference)``: the verify run (convert's, with the recipe's inputs)."""
    from ..engines.vllm_write import write_vllm
    from .quantize import quantize

    t0 = time.perf_counter()
    ep = _check(r)
    src = src if src is not None else r.source.path
    if src is None:
        raise ConfigError(f"{r.origin}: no source: give SRC or source.path in the recipe.")
    ck = open_checkpoint(src)
    check_model_type(r, ck.config, ck.root)
    out = guard_out(out, [ck.root])
    times: dict[str, float] = {}
    cut_from = ck.root
    # vLLM on the recipe's serving device (auto: this machine's), before any byte is written
    device = resolve_device(r.output.serving_device, engine_output=True)
    strict = r.output.strict_serving
    serving = ServingTarget(tp=r.layout.tp, moe_ep=ep, device=device, strict=strict)
    checked = False
    if r.quantize is not None:
        inter = guard_out(out.parent / f"{out.name}.quantized", [ck.root, out])
        t = time.perf_counter()
        ident = _identity(r, ck)
        if not force and _made_by(inter) == ident:
            log(f"quantize: {inter} is this recipe's quantization of {ck.root}; reusing it")
        else:
            if inter.exists() and not force:
                raise ConfigError(
                    f"{inter}: exists and is not this recipe's quantization of {ck.root}; "
                    f"pass --force to redo it, or remove it."
                )
            serving_report(serving.check(None, ck.config, model=True), log=log)
            log(f"quantize -> {inter}")
            # (its plan is checked before it writes)
            quantize(src=ck.root, out=inter, recipe=r, force=force, progress=progress,
                     serving=serving, log=log)  # fmt: skip
            checked = True
            (inter / SIDECAR).write_text(json.dumps(ident) + "\n")
        times["quantize"] = time.perf_counter() - t
        cut_from = inter
    t = time.perf_counter()
    lay = r.layout
    log(f"shard --target vllm -> {out} (tp {lay.tp}, pp {lay.pp}, ep {ep})")
    res = write_vllm(src=cut_from, out=out, tp=lay.tp, pp=lay.pp, ep=ep, force=force,
                     progress=progress,
                     before_write=None if checked else vllm_check(serving, log))  # fmt: skip
    times["write"] = time.perf_counter() - t
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
        "quantized": str(cut_from) if cut_from != ck.root else None,
        "layout": {"tp": lay.tp, "pp": lay.pp, "ep": ep}, "rank_files": res.files,
        "rank_files_kept": res.files_resumed, "bytes": res.bytes_written, "seconds": times,
        "verify": vrep, "passed": None if vrep is None else bool(vrep["passed"]),
    }  # fmt: skip
    (out / REPORT).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def convert_target(r: Recipe, *, src, out: Path, force: bool, progress: bool, report_html,
                   verify, log) -> tuple[dict, int, int, dict | None]:  # fmt: skip
    """``convert`` for ``output.format: vllm`` (:data:`k3convert.targets.TARGETS`): the
    report, the rank files written and kept from an interrupted run, verify's report."""
    if report_html is not None:
        raise ConfigError("--report-html describes a stream; output.format vllm has none.")
    rep = convert_vllm(r, src=src, out=out, force=force, progress=progress, verify=verify,
                       log=log)  # fmt: skip
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
    if rep.get("quantized"):
        lines.append(f"  quantized   {rep['quantized']} (kept: the files are cut from it)")
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
