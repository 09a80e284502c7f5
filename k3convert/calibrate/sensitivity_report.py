"""The sensitivity scan's report: per-tensor scores, the table, JSON and the PNG plot.

:class:`SensitivityReport` is what :func:`k3convert.calibrate.sensitivity.scan_sensitivity`
returns; ``--auto-keep`` writes it as ``sensitivity.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.bounded import read_json
from ..errors import ConfigError

REPORT_FORMAT = "k3convert-sensitivity-v1"
REPORT_FILE = "sensitivity.json"


@dataclass
class TensorSensitivity:
    """One scored row. score: the method's measure with the row quantized under its
    planned scheme (alone); ladder_score: the same under the ladder scheme (None without
    a ladder); tokens: the real calibration tokens its Linear saw; chosen: kept (or
    moved to the ladder) by the last :func:`choose_keeps`; rank: its place in that
    choice (1 = chosen first)."""

    name: str
    layer: int | None
    expert: int | None
    params: int
    scheme: str
    tokens: int
    score: float
    ladder_score: float | None = None
    chosen: bool = False
    rank: int | None = None


@dataclass
class SensitivityReport:
    """What :func:`scan_sensitivity` measured (tensors in plan order)."""

    method: str
    ladder: str | None
    tensors: list[TensorSensitivity]
    calibration: dict = field(default_factory=dict)
    seconds: float = 0.0
    #: rows no real calibration token reached (score 0): routed experts the router never
    #: chose, and rows outside the decoder layers and the head (vision tower, MTP layers)
    unmeasured: list[str] = field(default_factory=list)
    selection: dict | None = None  # the last choose_keeps summary

    def by_name(self) -> dict[str, TensorSensitivity]:
        return {t.name: t for t in self.tensors}

    def ranked(self) -> list[TensorSensitivity]:
        return sorted(self.tensors, key=lambda t: (-t.score, t.name))

    def table(self, top: int | None = 20) -> str:
        rows = self.ranked()
        if top is not None:
            rows = rows[:top]
        w = max([len(t.name) for t in rows] + [6])
        lad = self.ladder is not None
        head = (
            f"{'#':>4}  {'tensor':<{w}}  {'layer':>5} {'expert':>6} {'params':>9} "
            f"{'tokens':>7} {'score':>11}" + (f" {'ladder':>11}" if lad else "") + "  chosen"
        )
        out = [
            f"sensitivity ({self.method}) of {len(self.tensors)} quantized tensor(s)"
            + (f", ladder {self.ladder}" if lad else "")
            + (f"; top {len(rows)}" if top is not None and len(rows) < len(self.tensors) else ""),
            head,
            "-" * len(head),
        ]
        for i, t in enumerate(rows, 1):
            ls = f" {t.ladder_score:>11.4g}" if lad else ""
            ch = f"#{t.rank}" if t.chosen else ""
            out.append(
                f"{i:>4}  {t.name:<{w}}  {_opt(t.layer):>5} {_opt(t.expert):>6} "
                f"{t.params:>9} {t.tokens:>7} {t.score:>11.4g}{ls}  {ch}"
            )
        if self.unmeasured:
            out.append(
                f"{len(self.unmeasured)} tensor(s) saw no calibration token (score 0: routed "
                f"experts never chosen, or outside the text decoder): "
                f"{', '.join(self.unmeasured[:4])}" + (", ..." if len(self.unmeasured) > 4 else "")
            )
        if self.selection is not None:
            out.append(self.selection["summary"])
        return "\n".join(out)

    def to_json(self) -> dict:
        return {
            "format": REPORT_FORMAT,
            "method": self.method,
            "ladder": self.ladder,
            "calibration": self.calibration,
            "seconds": self.seconds,
            "unmeasured": list(self.unmeasured),
            "selection": self.selection,
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
        }

    @classmethod
    def from_json(cls, doc: dict) -> SensitivityReport:
        if not isinstance(doc, dict) or doc.get("format") != REPORT_FORMAT:
            raise ConfigError(f"not a {REPORT_FORMAT} sensitivity report.")
        return cls(
            method=doc["method"], ladder=doc.get("ladder"),
            tensors=[TensorSensitivity(**t) for t in doc["tensors"]],
            calibration=dict(doc.get("calibration") or {}), seconds=float(doc.get("seconds", 0)),
            unmeasured=list(doc.get("unmeasured") or []), selection=doc.get("selection"),
        )  # fmt: skip

    def write(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (a directory gets ``sensitivity.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / REPORT_FILE
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, p)
        return p

    @classmethod
    def read(cls, path: str | os.PathLike) -> SensitivityReport:
        p = Path(path)
        if p.is_dir():
            p = p / REPORT_FILE
        data = read_json(p, "report", ConfigError)  # errors name the file
        try:
            return cls.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{p}: cannot read the sensitivity report ({e}).") from e

    def plot(self, path: str | os.PathLike, top: int = 30) -> Path:
        """A PNG bar chart of the ``top`` highest scores (chosen tensors highlighted)."""
        try:  # matplotlib is heavy: imported only for a plot
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ConfigError(
                f"--plot needs matplotlib, which is not installed ({e}); "
                f"pip install matplotlib, or drop --plot."
            ) from e
        rows = self.ranked()[:top]
        fig, ax = plt.subplots(figsize=(10, max(2.5, 0.28 * len(rows) + 1.2)))
        try:
            y = list(range(len(rows)))[::-1]
            colors = ["#d62728" if t.chosen else "#1f77b4" for t in rows]
            ax.barh(y, [t.score for t in rows], color=colors)
            if self.ladder is not None:
                ax.barh(y, [t.ladder_score or 0.0 for t in rows], color="#ff7f0e", height=0.35,
                        label=f"under {self.ladder}")  # fmt: skip
                ax.legend(loc="lower right")
            ax.set_yticks(y)
            ax.set_yticklabels([_short(t.name) for t in rows], fontsize=7)
            ax.set_xlabel(f"sensitivity ({self.method}); red: chosen")
            ax.set_title(f"top {len(rows)} of {len(self.tensors)} quantized tensors")
            fig.tight_layout()
            p = Path(path)
            fig.savefig(p, format="png", dpi=100)
        finally:
            plt.close(fig)
        return p


def _opt(v) -> str:
    return "-" if v is None else str(v)


def _short(name: str) -> str:
    return name.removesuffix(".weight").removeprefix("model.")


__all__ = ["REPORT_FILE", "REPORT_FORMAT", "SensitivityReport", "TensorSensitivity"]
