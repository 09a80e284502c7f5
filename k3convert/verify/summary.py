"""The verdict of a ``verify`` report in a few lines a reviewer can read, and the same
as JSON (``report["summary"]``): every figure next to its limit, what was not judged and
why, the reference the candidate was compared with, and the threshold family applied.

``build_summary(report)`` works on a full verify report and on the subset ``convert``
keeps in its ``report.json``; the terminal table, convert's summary and the HTML page
all print its ``lines``, so they say the same thing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..checkpoint import open_checkpoint
from ..errors import K3Error
from .metrics import DECISIVE_MARGIN, FAMILY_ABOUT, Thresholds, check, limit_checks

#: why a figure next to a PASS is not judged (the JSON ``reason`` of its check)
KLD_MAX_REASON = "the worst single position; the limit applies to the mean"
REL_ERR_REASON = (
    "max |candidate - reference| over all logits, relative to the reference's largest "
    "|logit|: quantization moves single logits a lot while the distribution barely "
    "changes, so only an exact resharding limits it; the KLD judges this candidate"
)
NO_LIMIT_REASON = "no limit set"


def _no_decisive_reason() -> str:
    return (
        f"no position where the reference's top token leads by >= {DECISIVE_MARGIN:g} nats "
        f"(near-flat logits, typical of a random-weight model); the KLD decides"
    )


def _g(x: Any, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _th(report: dict) -> Thresholds | None:
    th = report.get("thresholds")
    if th is None or isinstance(th, Thresholds):
        return th
    return Thresholds(max_kld=th.get("max_kld"), min_top1=th.get("min_top1"),
                      max_rel_err=th.get("max_rel_err"), kind=th.get("kind", "custom"))  # fmt: skip


def family_text(kind: str | None) -> str:
    """'nvfp4a16 family (NVFP4 weights ...)' for a thresholds kind."""
    if not kind:
        return "no limits"
    base = str(kind).removesuffix(" + flags")
    about = FAMILY_ABOUT.get(base)
    flags = ", with the limits given as flags" if base != kind else ""
    return f"{base} family" + (f" ({about})" if about else "") + flags


def _check(name: str, label: str, metric: str, value: Any, *, op: str | None = None,
           limit: Any = None, passed: bool | None = None, reason: str | None = None,
           **extra) -> dict:  # fmt: skip
    return {"check": name, "label": label, "metric": metric, "value": value, "op": op,
            "limit": limit, "judged": passed is not None, "passed": passed,
            "reason": reason, **extra}  # fmt: skip


def _checks(m: dict, th: Thresholds | None) -> list[dict]:
    """One row per figure the summary shows: judged ones with their limit and verdict,
    the others with why they are not judged."""
    rows = {r["name"]: r for r in limit_checks(m, th)} if th else {}
    kld = m.get("kld") or {}
    out = []
    nf = m.get("nonfinite_positions") or 0
    if nf:
        out.append(_check("nonfinite", "non-finite logits", "nonfinite_positions", nf, op="==",
                          limit=0, passed=False))  # fmt: skip
    r = rows.get("max_kld")
    out.append(_check("kld_mean", "KLD mean", "kld.mean", kld.get("mean"),
                      op="<=", limit=th.max_kld if th else None,
                      passed=r["passed"] if r else None,
                      reason=None if r else NO_LIMIT_REASON))  # fmt: skip
    out.append(_check("kld_max", "KLD max", "kld.max", kld.get("max"), reason=KLD_MAX_REASON))
    out.append(_top1(m, th, rows.get("min_top1")))
    r = rows.get("max_rel_err")
    out.append(_check("max_rel_err", "logits max rel err", "max_rel_err", m.get("max_rel_err"),
                      op="<=", limit=th.max_rel_err if th else None,
                      passed=r["passed"] if r else None,
                      reason=None if r else REL_ERR_REASON))  # fmt: skip
    return out


def _top1(m: dict, th: Thresholds | None, row: dict | None) -> dict:
    limit = th.min_top1 if th else None
    extra = {"all_positions": m.get("top1"), "positions": m.get("positions")}
    if "decisive_positions" in m:
        extra["decisive_positions"] = m["decisive_positions"]
    if row is not None:
        return _check("top1", "top-1 agreement", row["metric"], row["value"], op=">=",
                      limit=limit, passed=row["passed"], **extra)  # fmt: skip
    if limit is None:
        why = NO_LIMIT_REASON
    elif "decisive_positions" in m and not m["decisive_positions"]:
        why = _no_decisive_reason()
    else:
        why = NO_LIMIT_REASON
    return _check("top1", "top-1 agreement", "top1", m.get("top1"), op=">=", limit=limit,
                  reason=why, **extra)  # fmt: skip


def _verdict_of(report: dict, m: dict | None, th: Thresholds | None):
    if "passed" in report:
        return report.get("passed"), report.get("failure")
    if m and th:
        return check(m, th, report.get("layers") or None)
    return None, None


def build_summary(report: dict) -> dict:
    """``report["summary"]``: {passed, failure, threshold_family (+ about), reference
    ({path, kind, what, stored, runner, note, text}), checks ([{check, label, metric,
    value, op, limit, judged, passed, reason, ...}]), decode, lines}."""
    th = _th(report)
    m = report.get("logits") or None
    passed, failure = _verdict_of(report, m, th)
    kind = th.kind if th else None
    ref = dict(report.get("reference_info") or {})
    if not ref and report.get("reference"):
        ref = {"path": report["reference"], "kind": report.get("reference_kind")}
    if ref and not ref.get("text"):
        ref["text"] = reference_text(ref, report.get("reference_note"))
    out: dict[str, Any] = {
        "passed": passed,
        "failure": failure,
        "threshold_family": kind,
        "threshold_family_text": family_text(kind),
        "reference": ref or None,
        "checks": _checks(m, th) if m else [],
    }
    dec = report.get("decode")
    if dec:
        out["decode"] = {"steps": dec.get("steps"), "passed": dec.get("passed"),
                         "compared_by": dec.get("compared_by") or "same tokens and max rel err",
                         "failure": dec.get("failure")}  # fmt: skip
    out["lines"] = _lines(out, dec)
    return out


def reference_text(ref: dict, note: str | None = None) -> str:
    about = "; ".join(filter(None, (
        ref.get("what"), ref.get("stored") and f"stored {' + '.join(ref['stored'])}", note,
    )))  # fmt: skip
    text = str(ref.get("path")) + (f" ({about})" if about else "")
    return text + (f", run {ref['runner']}" if ref.get("runner") else "")


def _op_text(c: dict) -> str:
    """'0.0173 <= 0.035' or '0.2 > 0.05 FAIL' of a judged check."""
    v, lim = c["value"], c["limit"]
    spec = ".3f" if c["check"] == "top1" else ".3g"
    if c["passed"]:
        return f"{_g(v, spec)} {c['op']} {lim:g}"
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return f"not finite (limit {c['op']} {lim:g}) FAIL"
    bad = ">" if c["op"] == "<=" else "<"
    return f"{_g(v, spec)} {bad} {lim:g} FAIL"


def _lines(s: dict, dec: dict | None) -> list[str]:
    """The summary as text: a verdict line, then one line per figure."""
    word = {True: "PASS", False: "FAIL", None: "no verdict"}[s["passed"]]
    head = f"{word} against the limits of the {s['threshold_family_text']}"
    if s["failure"]:
        head += f": {s['failure']}"
    lines = [head]
    if s["reference"]:
        lines.append(f"reference: {s['reference']['text']}")
    checks = {c["check"]: c for c in s["checks"]}
    if "nonfinite" in checks:
        c = checks["nonfinite"]
        lines.append(f"candidate logits NaN/inf at {c['value']} position(s) FAIL")
    if "kld_mean" in checks:
        c, mx = checks["kld_mean"], checks["kld_max"]
        mean = _op_text(c) if c["judged"] else f"{_g(c['value'])} (not judged: {c['reason']})"
        lines.append(f"KLD mean {mean}, max {_g(mx['value'])} (the worst position; the "
                     f"limit is on the mean)")  # fmt: skip
    if "top1" in checks:
        lines.append(_top1_line(checks["top1"]))
    rel = checks.get("max_rel_err")
    if rel is not None and rel["judged"]:
        lines.append(f"logits max rel err {_op_text(rel)} (largest |candidate - reference| "
                     f"over the reference's largest |logit|)")  # fmt: skip
    if dec:
        ok = dec.get("passed")
        how = (f"mean KLD {_g(dec.get('kld_vs_full'))}" if "kld_vs_full" in dec
               else f"same tokens, max rel err {_g(dec.get('max_rel_err'))}")  # fmt: skip
        tail = "PASS" if ok else f"FAIL: {dec.get('failure')}"
        lines.append(f"decode: {dec.get('steps')} KV-cache steps vs full forwards ({how}): "
                     f"{tail}")  # fmt: skip
    return lines


def _top1_line(c: dict) -> str:
    if c["judged"]:
        if c["metric"] == "top1_decisive":
            return (f"top-1 agreement {_op_text(c)} on the {c['decisive_positions']} of "
                    f"{c['positions']} positions where the reference's top token leads by "
                    f"{DECISIVE_MARGIN:g} nats or more ({_g(c['all_positions'], '.3f')} over "
                    f"all)")  # fmt: skip
        return f"top-1 agreement {_op_text(c)}"
    return f"top-1 agreement {_g(c['value'], '.3f')} not judged: {c['reason']}"


__all__ = ["build_summary", "family_text", "reference_text"]


def reference_info(ref_kind: str, ref_path: Path, orig: Path | None, moved, cand_path: Path,
                   dtype: str, opened: dict | None = None) -> dict:  # fmt: skip
    """What the candidate is compared with, for the report: the checkpoint (path, why it
    is the reference - ``orig``: the original its provenance leads to, ``moved``: through
    a quantized checkpoint -, how it is stored) and what runs it."""
    if orig is not None and orig.resolve() == ref_path.resolve():
        what = (
            "the candidate checkpoint itself, unsharded" if orig.resolve() == cand_path.resolve()
            else "the quantized checkpoint the candidate was made from" if moved
            else "the original the candidate was converted from"
        )  # fmt: skip
    else:
        what = "the checkpoint named as the reference"
    stored: dict[str, int] = {}
    try:
        ck = (opened or {}).get(ref_path) or open_checkpoint(ref_path)
        if opened is not None:  # the run's reference, opened once
            opened[ref_path] = ck
        for name in ck.names():
            meta = ck.meta(name)
            stored[meta.storage] = stored.get(meta.storage, 0) + meta.nbytes
    except (K3Error, OSError):
        pass  # the run itself reports an unreadable reference
    runner = (
        "by transformers (its own model code) in float32"
        if ref_kind == "transformers"
        else f"unsharded by k3convert's runtime in {dtype}"
    )
    return {
        "path": str(ref_path.resolve()),
        "kind": ref_kind,
        "what": what,
        "stored": sorted(stored, key=lambda k: -stored[k]),
        "runner": runner,
    }
