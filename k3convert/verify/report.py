"""The ``verify`` report: a terminal table, a JSON file and an optional PNG plot.

Plain text (no rich) so it reads the same in a log file; JSON strictly finite so any
tool can load it; files written atomically so a killed run never leaves half a report.

Keys read from ``report`` (each optional): ``logits`` (compare_logits' dict),
``thresholds`` (Thresholds or its dict), ``passed`` / ``failure`` (else computed with
``check``), ``layers`` ([{"layer", "rel_l2"}]), ``decode`` ({steps, passed,
max_rel_err, argmax_equal[, kv_cache, kld_vs_full]}), ``time_s``, ``peak_rss_mib``,
``kld_per_position`` (or inside ``logits``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.output import write_error
from ..errors import ConfigError, OutputError
from .metrics import Thresholds, check, limit_checks, locate_divergence
from .summary import REL_ERR_REASON, build_summary

PLOT_FLOOR = 1e-12
_MAX_NAME = 60
_KLD_KEYS = ("mean", "median", "p90", "p99", "p99_9", "max")


# -- table ----------------------------------------------------------------------------
def _thresholds(report: dict) -> Thresholds | None:
    th = report.get("thresholds")
    if th is None or isinstance(th, Thresholds):
        return th
    if isinstance(th, dict):
        return Thresholds(
            max_kld=th.get("max_kld"),
            min_top1=th.get("min_top1"),
            max_rel_err=th.get("max_rel_err"),
            kind=th.get("kind", "custom"),
        )
    raise ConfigError(f"report: thresholds must be a dict, got {type(th).__name__}.")


def _e(x: Any) -> str:
    return "n/a" if x is None else f"{x:.4e}"


def _f(x: Any) -> str:
    return "n/a" if x is None else f"{x:.6f}"


def _i(x: Any) -> str:
    return "n/a" if x is None else str(x)


def _p(x: Any) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _quantized(report: dict) -> bool:
    """Whether the report's thresholds are a quantized family's (not exact)."""
    kind = (report.get("thresholds") or {}).get("kind") or "exact"
    return not str(kind).startswith("exact")


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def render_table(report: dict) -> str:
    """The report as plain text: logits metrics with their limits and PASS/FAIL, the
    per-layer hidden-state errors (all layers), decode, time and memory, the verdict."""
    lines: list[str] = []
    if report.get("candidate_note"):
        lines.append(f"candidate: {report['candidate_note']}")
    m = report.get("logits")
    th = _thresholds(report)
    if m:
        limits = {r["metric"]: r for r in limit_checks(m, th)} if th else {}
        kld = m.get("kld") or {}
        rows: list[tuple[str, str]] = [
            ("max_abs_err", _e(m.get("max_abs_err"))),
            ("max_rel_err", _e(m.get("max_rel_err"))),
            ("rel_l2", _e(m.get("rel_l2"))),
            ("cosine", _f(m.get("cosine"))),
            *((f"kld.{k}", _e(kld.get(k))) for k in _KLD_KEYS),
            ("top1", _f(m.get("top1"))),
            ("top1_mismatches", _i(m.get("top1_mismatches"))),
        ]
        if "decisive_positions" in m:
            rows += [
                ("decisive_positions", _i(m.get("decisive_positions"))),
                ("top1_decisive", _f(m.get("top1_decisive"))),
            ]
        if "ppl_tokens" in m:
            rows += [
                ("ppl_ref", _p(m.get("ppl_ref"))),
                ("ppl_cand", _p(m.get("ppl_cand"))),
                ("ppl_ratio", _p(m.get("ppl_ratio"))),
                ("ppl_tokens", _i(m.get("ppl_tokens"))),
            ]
        kind = f", thresholds: {th.kind}" if th else ""
        lines.append(f"logits ({_i(m.get('positions'))} positions{kind})")
        lines.append(f"  {'metric':<16} {'value':>12}  {'limit':<14} status")
        nf = m.get("nonfinite_positions") or 0
        if nf:
            lines.append(f"  {'nonfinite_pos':<16} {nf:>12}  {'== 0':<14} FAIL")
        unjudged = _unjudged(m, th)
        for name, value in rows:
            lim = limits.get(name)
            limit = f"{lim['op']} {lim['limit']:g}" if lim else unjudged.get(name, "-")
            status = _mark(lim["passed"]) if lim else ("not judged" if name in unjudged else "")
            lines.append(f"  {name:<16} {value:>12}  {limit:<14} {status}".rstrip())
        if "max_rel_err" in unjudged:  # the figure's meaning, next to it
            lines.append(f"  (max_rel_err: {REL_ERR_REASON})")
    layers = report.get("layers") or []
    if layers:
        lines += _layer_lines(layers, _quantized(report))
    dec = report.get("decode")
    if dec:
        lines += _decode_lines(dec)
    fid = report.get("fidelity")
    if fid:
        lines.append(
            f"release fidelity: {fid['summary']}"
            if fid.get("summary")
            else f"release fidelity: {fid['file']}: {fid.get('error')}"
        )
    if report.get("time_s") is not None:
        lines.append(f"time: {report['time_s']:.1f} s")
    if report.get("peak_rss_mib") is not None:
        lines.append(f"peak memory (RSS): {report['peak_rss_mib']:.1f} MiB")
    passed, failure = _verdict(report, m, th, layers)
    if m or report.get("summary"):
        summary = report.get("summary") or build_summary(report)
        head, *rest = summary["lines"]
        head = head.removesuffix(f": {failure}") if failure else head  # RESULT says it
        lines += [f"summary: {head}", *(f"  {x}" for x in rest)]
    if passed is not None:
        lines.append("RESULT: PASS" if passed else f"RESULT: FAIL: {failure}")
    return "\n".join(lines)


def _unjudged(m: dict, th: Thresholds | None) -> dict[str, str]:
    """Table rows shown with a limit that was not applied: {row: limit text}."""
    if th is None:
        return {}
    out = {}
    if th.max_rel_err is None:
        out["max_rel_err"] = "-"
    if th.min_top1 is not None and "decisive_positions" in m and not m["decisive_positions"]:
        out["top1_decisive"] = f">= {th.min_top1:g}"
    return out


def _verdict(report, m, th, layers) -> tuple[bool | None, str | None]:
    if "passed" in report:
        return bool(report["passed"]), report.get("failure")
    if m and th:
        return check(m, th, layers or None)
    return None, None


def _layer_lines(layers: list[dict], quantized: bool = False) -> list[str]:
    names = [str(e.get("layer", i))[:_MAX_NAME] for i, e in enumerate(layers)]
    w = max(5, *(len(n) for n in names))
    hit = locate_divergence(layers, quantized)
    out = ["hidden states (rel L2 error vs reference, per layer)"]
    out.append(f"  {'#':>3}  {'layer':<{w}}  {'rel_l2':>10}  {'x prev':>9}")
    prev = None
    for i, (e, name) in enumerate(zip(layers, names, strict=True)):
        x = e.get("rel_l2")
        shown = "inf/NaN" if x is None or not math.isfinite(x) else f"{x:.3e}"
        ratio = ""
        if prev is not None and x is not None and math.isfinite(x) and prev > 0:
            ratio = f"{x / prev:.3g}"
        note = ""
        if hit is not None and hit[0] == i:
            note = "  <- error starts here" if hit[1] else "  <- largest increase"
        out.append(f"  {i:>3}  {name:<{w}}  {shown:>10}  {ratio:>9}{note}".rstrip())
        prev = x if x is not None and math.isfinite(x) else None
    return out


def _decode_lines(dec: dict) -> list[str]:
    passed = dec.get("passed")
    verdict = "" if passed is None else f": {_mark(bool(passed))}"
    out = [f"decode ({_i(dec.get('steps'))} steps){verdict}"]
    out.append(f"  max_rel_err   {_e(dec.get('max_rel_err'))}")
    out.append(f"  argmax_equal  {_i(dec.get('argmax_equal'))}")
    if dec.get("kv_cache") is not None:
        out.append(f"  kv_cache      {dec['kv_cache']}")
    if "kld_vs_full" in dec:
        out.append(f"  kld_vs_full   {_e(dec.get('kld_vs_full'))}")
    if dec.get("compared_by"):
        out.append(f"  compared by   {dec['compared_by']}")
    return out


# -- files ----------------------------------------------------------------------------
def _nonfinite_path(obj: Any, path: str = "report") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path
    if isinstance(obj, dict):
        for k, v in obj.items():
            hit = _nonfinite_path(v, f"{path}[{k!r}]")
            if hit:
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _nonfinite_path(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def _umask() -> int:
    """The process's umask (read by setting it, then restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_write(path: str | os.PathLike, write: Callable[[Any], None], binary: bool) -> None:
    out = Path(path)
    if out.is_dir():
        raise OutputError(f"{out}: is a directory; give a file name.")
    if not out.parent.is_dir():
        raise OutputError(f"{out}: directory {out.parent} does not exist; create it first.")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        f = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with f:
            write(f)
            f.flush()
            # mkstemp creates 0600; a report is an ordinary file: the umask's permissions
            # (a file system without modes keeps its own)
            with contextlib.suppress(OSError):
                os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(e, out) from e
        raise


def write_json(report: dict, path: str | os.PathLike) -> None:
    """``report`` as JSON (sorted keys, indent 2), written to a temp file and renamed.

    Raises ValueError naming the key of any NaN / inf (the metrics give finite values
    or None; an infinite error must be stored as None)."""
    bad = _nonfinite_path(report)
    if bad:
        raise ValueError(f"{bad} is not finite; store None for an unbounded error.")
    text = json.dumps(report, sort_keys=True, indent=2, allow_nan=False, default=_jsonable)
    _atomic_write(path, lambda f: f.write(text + "\n"), binary=False)


def _jsonable(x: Any) -> Any:
    """Thresholds and numpy / torch scalars; anything else is a caller bug."""
    if isinstance(x, Thresholds):
        return x.as_dict()
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
        v = x.item()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"report holds a non-finite scalar {v}.")
        return v
    raise TypeError(f"report holds a {type(x).__name__}, which is not JSON-serializable.")


def plot(report: dict, path: str | os.PathLike) -> None:
    """A PNG of :func:`figure`, written to a temp file and renamed."""
    fig = figure(report)
    _atomic_write(path, lambda f: fig.savefig(f, format="png"), binary=True)


def figure(report: dict):
    """The plots of a report: per-layer hidden-state rel L2 error (log y over at least
    three decades, so a small change does not look like a cliff; exact zeros drawn below
    the smallest value, inf/NaN as red crosses at the top; where the error jumps, or else
    its largest increase, marked and named) and the KLD (per position as a sorted curve
    with its mean, or the summary as bars; the ``max_kld`` limit drawn against the mean
    it limits). The title holds the
    verdict and, on a failure, the failing metric. Agg canvas: no display, no global
    pyplot state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: install matplotlib or drop --plot."
        ) from None
    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    _plot_layers(ax1, report.get("layers") or [], _quantized(report))
    m = report.get("logits") or {}
    per_pos = report.get("kld_per_position") or m.get("kld_per_position")
    th = _thresholds(report)
    _plot_kld(ax2, per_pos, m.get("kld") or {}, th.max_kld if th else None)
    passed, failure = _verdict(report, m or None, th, report.get("layers"))
    if passed is not None:
        title = "verify: PASS" if passed else f"verify: FAIL: {failure or ''}".rstrip(": ")
        if len(title) > 110:
            title = title[:107] + "..."
        fig.suptitle(title, color="green" if passed else "red")
    fig.tight_layout()
    return fig


def _zero_at(values: list[float]) -> float:
    """Where an exact 0 is drawn on a log axis: a decade below the smallest positive
    value (never above PLOT_FLOOR), so no real value is drawn at the floor."""
    pos = [v for v in values if v > 0]
    return min(PLOT_FLOOR, min(pos) / 10) if pos else PLOT_FLOOR


def _log_span(ax, values: list[float], decades: float = 3.0) -> None:
    """Log-axis limits spanning at least ``decades`` around the values."""
    lo, hi = min(values), max(values)
    ax.set_ylim(min(lo / 2, hi / 10**decades), max(hi * 2, lo * 10**decades))


def _plot_layers(ax, layers: list[dict], quantized: bool = False) -> None:
    ax.set_title("hidden state: rel L2 error vs reference")
    if not layers:
        ax.text(0.5, 0.5, "no per-layer data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = list(range(len(layers)))
    vals = [e.get("rel_l2") for e in layers]
    zero = _zero_at([v for v in vals if _finite(v)])
    good = [(i, v if v > 0 else zero) for i, v in zip(xs, vals, strict=True) if _finite(v)]
    bad = [i for i, v in zip(xs, vals, strict=True) if not _finite(v)]
    if good:
        ax.plot([i for i, _ in good], [v for _, v in good], marker=".", lw=1, label="rel L2")
    top = max([v for _, v in good], default=1.0) * 10
    if bad:
        ax.plot(bad, [top] * len(bad), "x", color="red", label="inf / NaN")
    ax.set_yscale("log")
    _log_span(ax, [v for _, v in good] + ([top] if bad else []) or [1.0])
    ax.set_xlabel("layer")
    ax.set_ylabel(f"rel L2 (0 drawn at {zero:.0e})")
    hit = locate_divergence(layers, quantized)
    if hit is not None:  # (i, True): the error jumps there; (i, False): its largest increase
        name = str(layers[hit[0]].get("layer", hit[0]))
        what = "error jumps at" if hit[1] else "largest increase at"
        ax.axvline(hit[0], color="orange", ls="--", lw=1, label=f"{what}: {name}")
    if len(layers) <= 12:
        ax.set_xticks(xs, [str(e.get("layer", i))[-14:] for i, e in enumerate(layers)])
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def _plot_kld(ax, per_pos: list | None, summary: dict, max_kld: float | None) -> None:
    vals = sorted(v for v in (per_pos or []) if _finite(v))
    limit = f"max_kld {max_kld:g} (limits the mean)" if max_kld else None
    if vals:
        ax.set_title("KL(ref || cand) per position")
        n, zero = len(vals), _zero_at(vals)
        shown = [v if v > 0 else zero for v in vals]
        ax.plot([100.0 * (i + 0.5) / n for i in range(n)], shown, label="per position")
        mean = sum(vals) / n
        ax.axhline(max(mean, zero), color="tab:blue", ls=":", lw=1, label=f"mean {mean:.3g}")
        if max_kld:
            ax.axhline(max_kld, color="red", ls="--", lw=1, label=limit)
        ax.set_xlabel("positions, sorted (percentile)")
        ax.set_yscale("log")
        _log_span(ax, shown + [max(mean, zero)] + ([max_kld] if max_kld else []))
    else:
        ax.set_title("KL(ref || cand): summary over positions")
        keys = [k for k in _KLD_KEYS if _finite(summary.get(k))]
        if not keys:
            ax.text(0.5, 0.5, "no KLD data", ha="center", va="center", transform=ax.transAxes)
            return
        zero = _zero_at([summary[k] for k in keys])
        shown = [summary[k] if summary[k] > 0 else zero for k in keys]
        ax.bar(keys, shown)
        if max_kld and "mean" in keys:  # the limit applies to the mean alone
            x = keys.index("mean")
            ax.hlines(max_kld, x - 0.45, x + 0.45, color="red", ls="--", lw=1.5, label=limit)
        ax.set_yscale("log")
        _log_span(ax, shown + ([max_kld] if max_kld else []))
    ax.set_ylabel(f"KLD, nats (0 drawn at {zero:.0e})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
