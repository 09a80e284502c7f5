"""The loss report: what a conversion did to the values the release shipped.

A tensor whose stored encoding changes (a release's MXFP4 experts written as NVFP4,
fp8-block or int4; an FP8 release requantized) is compared with the release's own
decode: how many values and how many of the release's scale groups changed, the
relative squared error ``sum (out - src)**2 / sum src**2`` and the largest absolute
error. A transcode that holds every value (MXFP4 -> NVFP4 / FP8 where the exponents fit,
:mod:`.fp4_requant`) is "exact". Tensors kept as stored, and sources that are not encoded
(a bf16 checkpoint quantized), are not in it: there is no released encoding to be
faithful to, and the quantization error is then what verify measures.

``quantize`` writes ``OUT/transcode_report.json`` (:data:`FILE`) and one summary line,
``convert`` puts the same in its report.json / HTML, and verify names the file where the
checkpoint it checks carries one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FILE = "transcode_report.json"
FORMAT = "k3convert-transcode-report-v1"
#: values compared per step (two float32 bands of this size at most)
_BAND = 1 << 20


@dataclass(frozen=True)
class TensorLoss:
    """One converted tensor against its release decode (see the module doc)."""

    name: str
    source: str  # the release's encoding
    target: str  # the scheme written
    values: int
    changed: int
    groups: int  # the release's scale groups (one scale each)
    groups_changed: int
    group: tuple[int, int]  # (rows, cols) of one release scale group
    rel_err: float
    max_abs_err: float

    @property
    def exact(self) -> bool:
        return self.changed == 0

    def to_json(self) -> dict:
        """Strict JSON: a non-finite error (a comparison against an all-zero tensor that
        changed) is ``null``, never a ``NaN`` / ``Infinity`` literal."""
        d = asdict(self)
        d["group"] = list(self.group)
        d["exact"] = self.exact
        for k in ("rel_err", "max_abs_err"):
            d[k] = d[k] if math.isfinite(d[k]) else None
        return d


def measure(name: str, source: str, target: str, src: torch.Tensor, out: torch.Tensor,
            group: tuple[int, int]) -> TensorLoss:  # fmt: skip
    """Compare 2-D ``out`` (the written tensor, dequantized) with ``src`` (the release's
    decode), a band of rows at a time in float32 (both are exact in it), sums in float64.
    ``group``: the release's scale block (rows, cols); edge blocks may be partial."""
    if src.shape != out.shape or src.ndim != 2:
        raise ValueError(f"{name}: cannot compare {tuple(out.shape)} with {tuple(src.shape)}")
    rows, cols = src.shape
    g0, g1 = max(1, min(group[0], rows)), max(1, min(group[1], cols))
    nb0, nb1 = -(-rows // g0), -(-cols // g1)
    hit = torch.zeros(nb0, nb1, dtype=torch.bool)
    band = max(g0, (_BAND // max(cols, 1)) // g0 * g0)
    changed, err2, ref2, worst = 0, 0.0, 0.0, 0.0
    for r0 in range(0, rows, band):
        a = src[r0 : r0 + band].float()
        d = out[r0 : r0 + band].float() - a
        nz = d != 0
        n = int(nz.sum())
        if n:
            changed += n
            err2 += float(d.double().square().sum())
            worst = max(worst, float(d.abs().amax()))
            r = nz.shape[0]
            pad_r, pad_c = -r % g0, -cols % g1
            m = torch.nn.functional.pad(nz, (0, pad_c, 0, pad_r)) if pad_r or pad_c else nz
            blk = m.view(-(-r // g0), g0, nb1, g1).any(3).any(1)
            hit[r0 // g0 : r0 // g0 + blk.shape[0]] |= blk
        ref2 += float(a.double().square().sum())
    return TensorLoss(
        name, source, target, rows * cols, changed, nb0 * nb1, int(hit.sum()), (g0, g1),
        err2 / ref2 if ref2 > 0 else (0.0 if err2 == 0 else float("inf")), worst,
    )  # fmt: skip


def from_sums(name: str, source: str, target: str, shape, group: tuple[int, int],
              sums: Mapping) -> TensorLoss:  # fmt: skip
    """The :class:`TensorLoss` of a transcode that measured what it rounded while writing
    (``sums``: ``err2``, ``ref2``, ``max_abs``, ``changed``, ``groups_changed``; see
    :func:`k3convert.quant.mx_int4.search`): :func:`measure`'s figures without a decode of
    the output."""
    rows, cols = shape
    g0, g1 = max(1, min(group[0], rows)), max(1, min(group[1], cols))
    err2, ref2 = float(sums["err2"]), float(sums["ref2"])
    return TensorLoss(
        name, source, target, rows * cols, int(sums["changed"]),
        -(-rows // g0) * -(-cols // g1), int(sums["groups_changed"]), (g0, g1),
        err2 / ref2 if ref2 > 0 else (0.0 if err2 == 0 else float("inf")),
        float(sums["max_abs"]),
    )  # fmt: skip


def exact(name: str, source: str, target: str, shape, group: tuple[int, int]) -> TensorLoss:
    """A tensor known to be transcoded exactly (no comparison needed)."""
    rows, cols = shape
    g0, g1 = max(1, min(group[0], rows)), max(1, min(group[1], cols))
    return TensorLoss(name, source, target, rows * cols, 0, -(-rows // g0) * -(-cols // g1),
                      0, (g0, g1), 0.0, 0.0)  # fmt: skip


class LossReport:
    """Every :class:`TensorLoss` of one conversion, by tensor name; ``unmeasured``: tensors
    it re-encoded that were not measured (a resumed ``convert``: written by the earlier
    run)."""

    def __init__(self, entries: Iterable[TensorLoss] = (), unmeasured: Iterable[str] = ()):
        self.entries = sorted(entries, key=lambda e: e.name)
        self.unmeasured = sorted(unmeasured)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def exact(self) -> list[TensorLoss]:
        return [e for e in self.entries if e.exact]

    def worst(self, n: int = 3) -> list[TensorLoss]:
        lossy = [e for e in self.entries if not e.exact]
        return sorted(lossy, key=lambda e: (-e.rel_err, e.name))[:n]

    def to_json(self) -> dict:
        values = sum(e.values for e in self.entries)
        changed = sum(e.changed for e in self.entries)
        return {
            "format": FORMAT,
            "tensors": len(self.entries),
            "exact": len(self.exact),
            "values": values,
            "values_changed": changed,
            "sources": sorted({e.source for e in self.entries}),
            "targets": sorted({e.target for e in self.entries}),
            "worst": [e.name for e in self.worst(10)],
            "unmeasured": self.unmeasured,
            "entries": [e.to_json() for e in self.entries],
        }

    def summary(self) -> str:
        """One line: how many transcoded tensors are exact, and the worst ones."""
        if not self.entries and not self.unmeasured:
            return ""
        srcs = "/".join(sorted({_short(e.source) for e in self.entries})) or "the release"
        head = (f"{len(self.exact)} of {len(self.entries)} tensors re-encoded from {srcs} "
                f"hold every released value")  # fmt: skip
        tail = (f"; {len(self.unmeasured)} more, written by an earlier (interrupted) run, "
                f"were not measured (--force converts and measures them all)"
                if self.unmeasured else "")  # fmt: skip
        bad = self.worst(3)
        if not bad:
            return head + (" (bit-exact)" if self.entries else "") + tail
        lossy = len(self.entries) - len(self.exact)
        worst = "; ".join(
            f"{e.name} (rel err {e.rel_err:.2e}, {e.groups_changed} of {e.groups} groups)"
            for e in bad
        )
        return f"{head}; {lossy} changed, worst: {worst}{tail}"

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_json(cls, doc: Mapping) -> LossReport:
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        out = []
        for e in doc.get("entries", []):
            e = {k: v for k, v in e.items() if k != "exact"}
            e["group"] = tuple(e["group"])
            for k in ("rel_err", "max_abs_err"):  # null: not finite (see TensorLoss.to_json)
                if k in e and e[k] is None:
                    e[k] = float("inf")
            out.append(TensorLoss(**e))
        return cls(out, doc.get("unmeasured", ()))


def _short(encoding: str) -> str:
    return encoding.removesuffix("-pack-quantized").removesuffix("-quantized")
