"""``convert --report-html F``: one self-contained HTML page (no external files, no
scripts): the run's summary table, the per-stage times and verify's parity figures, with
verify's plot (per-layer hidden-state error, per-position KLD) embedded as a PNG data URI
when matplotlib is installed."""

from __future__ import annotations

import base64
import html
import os
import tempfile
from pathlib import Path

from .units import human_bytes
from .verify.report import plot
from .verify.summary import build_summary


def _rows(rep: dict) -> list[tuple[str, str]]:
    s, lay = rep["sizes"], rep["layout"]
    rows = [
        ("recipe", rep["recipe"]),
        ("source", rep["source"]),
        ("output", rep["out"]),
        ("model", str(rep.get("model_type"))),
        (
            "layout",
            f"tp={lay['tp']} pp={lay['pp']} moe_tp={lay['moe_tp']} moe_ep={lay['moe_ep']} "
            f"redundant_experts={lay['redundant_experts']} ({lay['world']} ranks)",
        ),
        ("processes", str(rep["processes"])),
        ("source size", human_bytes(s["source_bytes"])),
    ]
    if s.get("quantized_bytes"):
        rows.append(("quantized size", human_bytes(s["quantized_bytes"])))
    rows.append(("stream size", f"{human_bytes(s['stream_bytes'])} in {s['units']} units"))
    q = rep.get("quantize")
    if q:
        cal = (q.get("calibration") or {}).get("algorithm")
        rows.append((
            "quantized tensors",
            f"{q['quantized']} of {q['tensors']} ({', '.join(q['schemes']) or 'none'})"
            + (f", calibrated with {cal}" if cal else ""),
        ))  # fmt: skip
    for k, v in rep["seconds"].items():
        rows.append((f"time: {k}", f"{v:.2f} s"))
    return rows


def _verify_rows(v: dict) -> list[tuple[str, str]]:
    """Verify's summary (the figures next to their limits, what was not judged and why,
    the reference, the threshold family), then the detail figures."""
    lg = v.get("logits") or {}
    th = v.get("thresholds") or {}
    kld = lg.get("kld") or {}
    s = v.get("summary") or build_summary(v)
    rows = [("threshold family", s["threshold_family_text"])]
    if s.get("reference"):
        rows.append(("reference", s["reference"]["text"]))
    rows += [(c["label"], _check_text(c)) for c in s["checks"]]
    rows += [
        ("KLD p99", _num(kld.get("p99"))),
        *_decisive(lg),
        ("cosine", _num(lg.get("cosine"))),
        ("thresholds", _limits(th)),
    ]
    dec = v.get("decode")
    if dec:
        rows.append(
            ("decode check", "pass" if dec.get("passed") else f"FAIL: {dec.get('failure')}")
        )
    return rows


def _check_text(c: dict) -> str:
    """'0.0173 (limit <= 0.035: pass)' or '0.344 (not judged: why)'."""
    value = _num(c["value"])
    if c["judged"]:
        return f"{value} (limit {c['op']} {_num(c['limit'])}: {'pass' if c['passed'] else 'FAIL'})"
    return f"{value} (not judged: {c['reason']})"


def _decisive(lg: dict) -> list[tuple[str, str]]:
    if "decisive_positions" not in lg:
        return []
    n = lg["decisive_positions"]
    text = f"{_num(lg.get('top1_decisive'))} on {n} positions" if n else "none (not judged)"
    return [("top-1 where the reference is decisive", text)]


def _limits(th: dict) -> str:
    """The limits verify applied, the ones it did not set left out (not ``<= -``)."""
    parts = [f"{what} {op} {_num(th[key])}" for what, op, key in (
        ("KLD", "<=", "max_kld"), ("top-1", ">=", "min_top1"), ("rel err", "<=", "max_rel_err"),
    ) if th.get(key) is not None]  # fmt: skip
    return f"{th.get('kind')}: {', '.join(parts) or 'none'}"


def _fidelity(f: dict) -> str:
    """The loss report's section: its summary line and the worst tensors."""
    head = (
        f"<p>{html.escape(f['summary'])} (every tensor: <code>{html.escape(f['file'])}</code>)</p>"
    )
    if not f.get("worst"):
        return head
    cells = ("tensor", "from", "to", "values changed", "groups changed", "rel. error")
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            e["name"], e["source"], e["target"], f"{e['changed']} of {e['values']}",
            f"{e['groups_changed']} of {e['groups']}", f"{e['rel_err']:.3g}",
        )) + "</tr>"
        for e in f["worst"]
    )  # fmt: skip
    th = "".join(f"<th>{c}</th>" for c in cells)
    return head + f"<table><tr>{th}</tr>{rows}</table>"


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


def _plot_uri(verify_report: dict | None) -> str | None:
    if verify_report is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "verify.png"
        plot(verify_report, p)
        return "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _placement(experts: dict) -> str:
    """Which routed experts each EP rank holds (the stream manifest's placement): per rank
    the experts of the first MoE layer, how many it holds per layer, and with routing
    counts the share of the routed tokens it serves (lowest and highest over layers)."""
    layers = experts["layers"]
    first = min(layers, key=int)
    n_ep = len(layers[first]["ep_rank_experts"])
    head = (
        f"<p>{experts['num_experts']} routed experts per layer over {n_ep} EP ranks, "
        f"placement {html.escape(str(experts['policy']))}"
        + (f", {experts['redundant']} redundant copies per layer" if experts["redundant"] else "")
        + f"; {len(layers)} MoE layers.</p>"
    )
    rows = ["<tr><th>EP rank</th><th>experts (layer " + html.escape(first) + ")</th>"
            "<th>experts held per layer</th><th>share of routed tokens</th></tr>"]  # fmt: skip
    for r in range(n_ep):
        held = [len(v["ep_rank_experts"][r]) for v in layers.values()]
        shares = []
        for v in layers.values():
            load = v.get("load")
            if load and sum(load):  # a copied expert's tokens are split over its copies
                copies = [len(rk) for rk in v["expert_ep_ranks"]]
                mine = sum(load[e] / copies[e] for e in v["ep_rank_experts"][r])
                shares.append(mine / sum(load))
        lo, hi = (f"{min(shares):.1%}", f"{max(shares):.1%}") if shares else ("-", "-")
        share = lo if lo == hi else f"{lo} - {hi}"
        count = str(held[0]) if min(held) == max(held) else f"{min(held)} - {max(held)}"
        ids = _ranges(layers[first]["ep_rank_experts"][r])
        rows.append(f"<tr><td>{r}</td><td>{html.escape(ids)}</td><td>{count}</td>"
                    f"<td>{share}</td></tr>")  # fmt: skip
    return head + "<table>" + "".join(rows) + "</table>"


def write_html(
    report: dict, verify_report: dict | None, path: str | os.PathLike, experts: dict | None = None
) -> Path:
    """Write the page (to a temporary name, then renamed); returns its path. experts: the
    stream's expert placement (``manifest.json`` layout.experts), shown per EP rank."""
    title = f"k3convert convert: {Path(report['source']).name}"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em}"
        "table{border-collapse:collapse;margin-bottom:1.5em}"
        "th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}"
        "th{background:#f4f4f4;font-weight:normal}.pass{color:#070}.fail{color:#a00}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
    ]
    passed = report.get("passed")
    if passed is not None:
        failure = (report.get("verify") or {}).get("failure")
        cls, word = ("pass", "PASS") if passed else ("fail", "FAIL")
        tail = f": {html.escape(failure)}" if failure and not passed else ""
        parts.append(f"<p class='{cls}'><b>verify: {word}</b>{tail}</p>")  # the verdict, once
    parts += ["<h2>Summary</h2>", _table(_rows(report))]
    if experts and experts.get("layers"):
        parts += ["<h2>Expert placement</h2>", _placement(experts)]
    if report.get("fidelity"):
        parts += ["<h2>Fidelity to the release</h2>", _fidelity(report["fidelity"])]
    if report.get("verify"):
        lines = (report["verify"].get("summary") or build_summary(report["verify"]))["lines"]
        text = "<br>".join(html.escape(x) for x in lines)  # what the terminal printed
        parts += ["<h2>Parity</h2>", f"<p class='summary'>{text}</p>",
                  _table(_verify_rows(report["verify"]))]  # fmt: skip
    uri = _plot_uri(verify_report)
    if uri:
        parts.append(f"<h2>Verify plots</h2><img alt='verify plots' src='{uri}'>")
    elif report.get("verify"):
        parts.append("<p>(plots need matplotlib: <code>pip install matplotlib</code>)</p>")
    parts.append("</body></html>\n")
    p = Path(path)
    tmp = p.with_name(p.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(parts), encoding="utf-8")
    os.replace(tmp, p)
    return p
