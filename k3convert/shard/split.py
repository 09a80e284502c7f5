"""Split rules: how one logical tensor (with all its quantization parts) is cut.

A logical tensor is cut along one logical dim into ``n`` pieces. Every physical part
follows as the format registry (:mod:`k3convert.formats`) says: plain data and FP8 /
int8 weights slice the same dim; scales and zero points slice in units of their block /
group; packed int-N words slice in units of ``32 / num_bits`` values; MXFP4 / NVFP4
bytes (two values each) slice by rows freely and by columns only on group boundaries
(32 / 16 values = 16 / 8 bytes, with their scales); per-tensor and global scales (and
scales constant along the split dim) are copied whole. A boundary that would fall
inside an attention head, a quantization group / block, a packed int32 word or an FP4
byte is refused up front with a :class:`SplitError` naming the tensor, the dimension and
the degrees that would work.

Modes: ``even`` (equal pieces, e.g. heads / MLP columns) and ``pad`` (vocab-parallel:
pieces of ``ceil(V/n)`` rounded up to the alignment, the last piece zero-padded).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..checkpoint import PartMeta, TensorMeta
from ..formats import COPY, FORMATS, AxisMap, UnsplittableError
from ..formats import LOCAL_SHAPE as SHAPE
from ..layout import divisors
from ..stream.format import SplitError


class PartSlice(NamedTuple):
    """One part's share of a piece: ``src[dim][start:start+length]`` then ``pad`` zeros.
    (A named tuple: a plan of a large layout builds millions of them.)"""

    part: str
    src: PartMeta
    dim: int | None
    start: int
    length: int
    pad: int
    shape: tuple[int, ...]  # local shape (padding included)
    contents: str = "data"  # or "local_shape"
    value: tuple[int, ...] | None = None  # for contents == "local_shape"


class Piece(NamedTuple):
    """Piece ``index`` of ``count`` of a logical tensor along logical dim ``dim``."""

    index: int
    count: int
    dim: int | None
    start: int
    length: int
    pad: int
    parts: tuple[PartSlice, ...]


def axis_maps(m: TensorMeta, d: int) -> dict[str, AxisMap | str]:
    """Per part: how it follows a split of logical dim ``d`` (the format registry's
    :meth:`k3convert.formats.Encoding.axis_maps`)."""
    try:
        return FORMATS[m.encoding].axis_maps(m, d)
    except UnsplittableError as e:
        raise SplitError(str(e)) from None


def _bounds(length: int, n: int, mode: str, granule: int, align: int) -> list[tuple[int, int]]:
    """(start, real length) per piece, before the legality checks."""
    if mode == "even":
        chunk = length // n
    else:
        chunk = math.lcm(align, granule) * -(-length // (n * math.lcm(align, granule)))
    return [(k * chunk, max(0, min(chunk, length - k * chunk))) for k in range(n)]


def _problem(
    m: TensorMeta, d: int, n: int, mode: str, granule: int, maps: dict, what: str
) -> str | None:
    """Why splitting into n pieces is illegal (None when it is legal)."""
    if n == 1:
        return None
    length = m.shape[d]
    amaps = {p: a for p, a in maps.items() if isinstance(a, AxisMap)}
    align = math.lcm(*(a.align for a in amaps.values())) if amaps else 1
    if mode == "even" and (length % granule or (length // granule) % n):
        return f"{length // granule} {what} do not divide into {n} equal pieces"
    bounds = _bounds(length, n, mode, granule, align)
    if mode == "pad" and any(ln == 0 for _, ln in bounds):
        return f"{n} pieces of {bounds[0][1]} rows (aligned to {align}) leave some ranks empty"
    for start, _ in bounds[1:]:
        for part, a in amaps.items():
            if start % a.align:
                return f"a boundary at {start} would cut a {a.what} (in '{part}')"
    return None


def legal_degrees(m: TensorMeta, d: int, mode: str, granule: int, limit: int = 128) -> list[int]:
    maps = axis_maps(m, d)
    top = min(limit, max(1, m.shape[d]))
    return [k for k in range(1, top + 1) if _problem(m, d, k, mode, granule, maps, "") is None]


def split_tensor(
    m: TensorMeta,
    d: int,
    n: int,
    *,
    mode: str = "even",
    granule: int = 1,
    what: str = "rows",
    degree_name: str = "tp",
) -> list[Piece]:
    """Cut ``m`` along logical dim ``d`` into ``n`` pieces (see module docstring).

    ``n == 1`` gives the whole tensor (``dim`` None, every part unsplit), as the spec
    records a part a rank holds whole, e.g. a single KV head every rank holds.
    """
    if n == 1:
        return [whole(m)]
    maps = axis_maps(m, d)
    why = _problem(m, d, n, mode, granule, maps, what)
    if why:
        legal = legal_degrees(m, d, mode, granule)
        hint = " (or re-quantize with smaller blocks / groups)" if "would cut" in why else ""
        raise SplitError(
            f"cannot split '{m.name}' ({m.encoding}, shape {list(m.shape)}) along dim {d} "
            f"into {degree_name}={n} pieces: {why}. Degrees that work for this tensor: "
            f"{legal}; pick {degree_name} among them{hint}."
        )
    amaps = [a for a in maps.values() if isinstance(a, AxisMap)]
    align = math.lcm(*(a.align for a in amaps)) if amaps else 1
    bounds = _bounds(m.shape[d], n, mode, granule, align)
    chunk = bounds[0][1]
    pieces = []
    for k, (start, ln) in enumerate(bounds):
        parts = []
        local_logical = list(m.shape)
        local_logical[d] = chunk
        for part, pm in m.parts.items():
            a = maps[part]
            if a == COPY:
                parts.append(PartSlice(part, pm, None, 0, 0, 0, tuple(pm.shape)))
            elif a == SHAPE:
                parts.append(
                    PartSlice(
                        part, pm, None, 0, 0, 0, tuple(pm.shape), "local_shape",
                        tuple(local_logical),
                    )
                )  # fmt: skip
            else:
                p0, p1 = a.index(start), a.index(start + ln)
                full = a.index(chunk)  # aligned start: a full piece's part length
                shape = list(pm.shape)
                shape[a.dim] = full
                parts.append(
                    PartSlice(part, pm, a.dim, p0, p1 - p0, full - (p1 - p0), tuple(shape))
                )
        pieces.append(Piece(k, n, d, start, ln, chunk - ln, tuple(parts)))
    return pieces


def part_range(
    m: TensorMeta, part: str, d: int, a: int, b: int, maps: dict | None = None
) -> tuple[int, int] | None:
    """Logical ``[a, b)`` of dim ``d`` of ``m`` as ``part``'s ``[lo, hi)`` along that dim,
    by the format registry's axis map (None: the part does not follow a cut of ``d``: a
    per-tensor or constant-along-``d`` scale, a stored shape). A boundary strictly inside
    the dim must fall on the part's granule (a group / block, a packed word, an FP4
    byte): :class:`SplitError` names the one it would cut. ``maps``: :func:`axis_maps` of
    ``(m, d)``, when the caller already has them."""
    amap = (maps or axis_maps(m, d))[part]
    if not isinstance(amap, AxisMap):
        return None
    full = m.shape[d]
    for x in (a, b):
        if 0 < x < full and x % amap.align:
            raise SplitError(
                f"'{m.name}' ({m.encoding}): a boundary at {x} of its {full} along dim {d} "
                f"would cut a {amap.what or 'granule'} of '{part}'; pick a degree whose "
                f"slices are multiples of {amap.align}, or re-quantize with smaller groups."
            )
    return amap.index(a), amap.index(b)


def whole(m: TensorMeta) -> Piece:
    """The unsplit tensor as a single piece (replicated tensors)."""
    parts = tuple(PartSlice(p, pm, None, 0, 0, 0, tuple(pm.shape)) for p, pm in m.parts.items())
    return Piece(0, 1, None, 0, 0, 0, parts)


__all__ = [
    "AxisMap",
    "PartSlice",
    "Piece",
    "divisors",
    "legal_degrees",
    "part_range",
    "split_tensor",
    "whole",
]
