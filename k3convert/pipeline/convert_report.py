"""``convert``'s report: ``OUT/report.json`` (sizes, time per stage, the quantization,
the release's fidelity, verify's figures) and its text summary."""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from ..checkpoint.bounded import read_json
from ..errors import K3Error
from ..quant import fidelity
from ..units import human_bytes
from ..verify.summary import build_summary

REPORT = "report.json"
REPORT_FORMAT = "k3convert-convert-report-v1"


def quantize_summary(prep, run: bool = True) -> dict:
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


def quantize_line(q: dict) -> str:
    """The summary's line of a report's quantize section."""
    cal = q.get("calibration") or {}
    return (
        f"  quantize    {q['quantized']} of {q['tensors']} tensors "
        f"({', '.join(q['schemes']) or 'none'})"
        + (f", calibrated ({cal.get('algorithm')})" if cal else "")
    )


def read_losses(out: Path):
    """The loss report a conversion left in ``out`` (None: none, or not readable as one)."""

    try:
        data = read_json(out / fidelity.FILE, "report")
        return fidelity.LossReport.from_json(data)
    except (K3Error, ValueError, TypeError, KeyError, AttributeError):
        return None


def fidelity_summary(losses) -> dict | None:
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


def build_report(r, ck, out, quantized, plan, res, times, vrep, group, inter, done=None,
            losses=None) -> dict:  # fmt: skip
    """report.json; ``quantized``: this run's :func:`quantize_summary` (None without a
    quantize section, or when ``done``: a complete stream verified again, whose run's own
    figures its sidecar holds)."""
    src_bytes = sum(f.size for f in ck.files())
    q = done.get("quantize") if done is not None else quantized
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
        "already_complete": done is not None,
        "seconds": {k: round(v, 3) for k, v in times.items()},
        "intermediate": str(inter) if inter is not None else None,
        "quantize": q,
        "fidelity": fidelity_summary(losses),
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
            "reference", "reference_kind", "reference_note", "reference_info", "seconds",
            "inputs", "summary")  # fmt: skip
    out = {k: v[k] for k in keep if k in v}
    if "summary" not in out:
        out["summary"] = build_summary(out)
    return out


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
    if rep.get("already_complete"):
        lines.append(
            "  rerun       OUT was already complete from this recipe and source: nothing "
            "rewritten, verified again (--force rewrites it)"
        )
    if rep.get("quantize"):
        lines.append(quantize_line(rep["quantize"]))
    if rep.get("fidelity"):
        lines.append(f"  fidelity    {rep['fidelity']['summary']}")
    secs = rep["seconds"]
    lines.append("  time        " + "  ".join(f"{k} {v:.1f} s" for k, v in secs.items()))
    v = rep.get("verify")
    if v:
        # verify's own summary: each figure next to its limit, what was not judged and
        # why, the reference and the threshold family
        head, *rest = (v.get("summary") or build_summary(v))["lines"]
        lines.append(f"  verify      {head}")
        lines += [f"              {x}" for x in rest]
    else:
        lines.append("  verify      skipped (verify.enabled: false)")
    lines.append(f"  report      {rep['out']}/{REPORT}")
    return "\n".join(lines)
