"""Cross-checks of a stream that the JSON Schema cannot express (spec sections 3, 4, 6).

The schema only says what a manifest may look like; a schema-valid manifest can still
lie about a unit (an edited ``encoding``, a renamed or reordered tensor, a path outside
the directory) while the unit's hash stays valid. Everything here is checked before
a unit's tensors are handed out, by the loader and by ``shard --check`` alike:

* :func:`check_paths` - every path the manifest names is relative, has no ``..``
  component and (:func:`inside`) resolves inside the stream directory, before any file
  is opened;
* :func:`check_unit_entries` - a unit's tensor table agrees with itself and with what
  each encoding needs (parts, dtypes, scale and packing geometry), split geometry
  (``split_dim`` null exactly when the rank holds the whole part), and sizes;
* :func:`check_header_layout` - the unit's own safetensors header lists the manifest's
  tensors in the manifest's order at the offsets the format implies, padding included;
* :func:`zstd_content_size` - a zstd unit is exactly one frame, with content size and
  checksum, and nothing after it.

Every problem raises :class:`StreamCorruptError` (damage, exit 1) or
:class:`ManifestError`, with the file, rank, unit and tensor in a one-line message.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath

import zstandard

from ..checkpoint.encodings import (
    ACTIVATION_PARTS,
    ALL_PARTS,
    ENCODINGS,
    QuantParams,
    scale_block,
)
from ..checkpoint.safetensors_io import MAX_HEADER_BYTES, ST_DTYPES
from .format import (
    ALIGN,
    PAD_PREFIX,
    ManifestError,
    StreamCorruptError,
    align_up,
    nbytes_of,
    unit_file,
)

_FIX = "re-create the stream with `k3convert shard --force`"
#: largest header region a unit may have (8-byte length + JSON, padded to ALIGN)
MAX_HEADER_REGION = align_up(8 + MAX_HEADER_BYTES)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


# -- paths ----------------------------------------------------------------------------
def path_problem(rel: object) -> str | None:
    """Why ``rel`` is not an acceptable manifest path (None when it is)."""
    if not isinstance(rel, str) or not rel:
        return "is not a non-empty string"
    if "\x00" in rel or "\\" in rel:
        return "contains a NUL byte or a backslash"
    p = PurePosixPath(rel)
    if p.is_absolute():
        return "is absolute"
    if any(part in ("..", ".", "") for part in rel.split("/")):
        return "has a '..', '.' or empty component"
    return None


def check_paths(doc: dict, mp: Path) -> None:
    """Refuse absolute, ``..`` and misnamed paths anywhere in the manifest (no I/O)."""
    for i, f in enumerate(doc["files"]):
        why = path_problem(f["name"])
        if why:
            raise ManifestError(
                f"{mp}: files[{i}].name {f['name']!r} {why}; carried files must be relative "
                f"paths inside the stream directory - the manifest is damaged or was edited, "
                f"{_FIX}."
            )
    for r in doc["ranks"]:
        if "units" in r:  # version 3: only the ranks loaded so far
            check_unit_paths(r, mp)


def check_unit_paths(r: dict, where: Path) -> None:
    """Refuse a unit of rank entry ``r`` whose file is not the format's name for it (so
    relative, inside its rank directory; no I/O). ``where``: the file listing ``r``'s
    units (manifest.json, or the version 3 rank file)."""
    for u in r["units"]:
        want = unit_file(r["rank"], u["index"], u["name"], u["compression"])
        if u["file"] != want:
            raise ManifestError(
                f"{where}: rank {r['rank']}, unit '{u['name']}': file {u['file']!r} is not "
                f"the format's name for it ({want!r}); the manifest is damaged or was "
                f"edited, {_FIX}."
            )


def inside(root: Path, rel: str, what: str) -> Path:
    """``root / rel`` after checking that it resolves inside ``root`` (symlinks
    followed); raises StreamCorruptError before anything is opened."""
    why = path_problem(rel)
    p = root / rel
    if why is None:
        try:
            top = root.resolve()
            real = p.resolve()
        except (OSError, RuntimeError) as e:  # symlink loop
            why = f"cannot be resolved ({e})"
        else:
            if real != top and top not in real.parents:
                why = f"resolves to {real}, outside the stream directory"
    if why:
        raise StreamCorruptError(f"{p} ({what}): path {rel!r} {why}; refusing to open it - {_FIX}.")
    return p


# -- the tensor table of one unit -------------------------------------------------------
def unit_data_bytes(u: dict) -> int:
    """Size of the data region the manifest's tensor table implies (padding included)."""
    pos = 0
    for e in u["tensors"]:
        pos = align_up(pos) + nbytes_of(e["dtype"], e["shape"])
    return pos


def check_unit_entries(u: dict, where: str) -> None:
    """The unit's manifest entry agrees with itself and with its encodings.

    where: names the manifest, rank and unit. Raises StreamCorruptError.
    """

    def bad(msg: str):
        raise StreamCorruptError(
            f"{where}: {msg}; the manifest disagrees with itself (edited or damaged) - {_FIX}."
        )

    if u["compression"] == "none" and (u["raw_bytes"] != u["bytes"] or u["raw_hash"] != u["hash"]):
        bad("an uncompressed unit must have raw_bytes == bytes and raw_hash == hash")
    names: set[str] = set()
    groups: dict[str, list[dict]] = {}
    for e in u["tensors"]:
        n = e["name"]
        if n.startswith(PAD_PREFIX):
            bad(f"tensor '{n}' uses the reserved prefix {PAD_PREFIX}")
        if n in names:
            bad(f"tensor '{n}' is listed twice")
        names.add(n)
        why = _geometry_problem(e)
        if why:
            bad(f"tensor '{n}': {why}")
        groups.setdefault(e["logical"], []).append(e)
    for logical, es in groups.items():
        why = _group_problem(es)
        if why:
            bad(f"logical tensor '{logical}': {why}")
    data = unit_data_bytes(u)
    head = u["raw_bytes"] - data
    if head < ALIGN or head > MAX_HEADER_REGION or head % ALIGN:
        bad(
            f"raw_bytes {u['raw_bytes']} does not fit its tensor table ({data} data bytes "
            f"plus a header region that is a multiple of {ALIGN}, at most {MAX_HEADER_REGION})"
        )


def _geometry_problem(e: dict) -> str | None:
    shape, glob, d = e["shape"], e["global_shape"], e["split_dim"]
    if e["part"] not in ALL_PARTS:
        return f"part '{e['part']}' is not a known part ({', '.join(ALL_PARTS)})"
    if e["contents"] == "local_shape" and (e["part"] != "weight_shape" or d is not None):
        return "contents 'local_shape' is only for an unsplit 'weight_shape' part"
    if len(shape) != len(glob):
        return f"shape {shape} and global_shape {glob} have different ranks"
    if d is None:
        if shape != glob or e["offset"] or e["pad"]:
            return (
                f"split_dim is null (the whole part) but shape {shape}, offset {e['offset']}, "
                f"pad {e['pad']} do not describe global_shape {glob}"
            )
        return None
    if d >= len(shape):
        return f"split_dim {d} is not a dimension of shape {shape}"
    if any(a != b for k, (a, b) in enumerate(zip(shape, glob, strict=True)) if k != d):
        return f"shape {shape} differs from global_shape {glob} outside split_dim {d}"
    if e["pad"] > shape[d] or e["offset"] + shape[d] - e["pad"] > glob[d]:
        return (
            f"piece [offset {e['offset']}, {shape[d] - e['pad']} + pad {e['pad']}) along dim {d} "
            f"does not fit global_shape {glob}"
        )
    if e["offset"] == 0 and e["pad"] == 0 and shape[d] == glob[d]:
        return (
            f"holds the whole part but records split_dim {d}; a part a rank holds whole "
            f"(replicated) has split_dim null"
        )
    if shape[d] == 0 or e["offset"] % shape[d]:
        return f"offset {e['offset']} is not a multiple of its piece length {shape[d]}"
    return None


def coverage_problems(doc: dict, mp: Path) -> list[str]:
    """Across ranks: the pieces of every split part tile it (copies may repeat), and a
    part is either split on every rank holding it or whole on every one."""
    seen: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for r in doc["ranks"]:
        for u in r["units"]:
            for e in u["tensors"]:
                seen.setdefault((u["name"], e["name"]), []).append((r["rank"], e))
    out = []
    for (unit, name), held in seen.items():
        if all(e["split_dim"] is None for _, e in held):
            continue  # whole on every rank holding it: nothing to tile
        if any(_geometry_problem(e) for _, e in held):
            continue  # reported with its unit
        dims = {e["split_dim"] for _, e in held}
        where = f"{mp}: unit '{unit}', tensor '{name}'"
        if len(dims) > 1:
            out.append(f"{where}: split_dim differs between ranks ({sorted(map(str, dims))}).")
            continue
        (d,) = dims
        if d is None:
            continue
        glob = held[0][1]["global_shape"]
        spans = sorted({(e["offset"], e["offset"] + e["shape"][d] - e["pad"]) for _, e in held})
        pos = 0
        for a, b in spans:
            if a != pos:
                out.append(
                    f"{where}: pieces along dim {d} "
                    f"{'overlap' if a < pos else 'leave a gap'} at {min(a, pos)} (ranks "
                    f"{sorted({r for r, _ in held})}); the offsets were edited or damaged."
                )
                break
            pos = b
        else:
            if pos != glob[d] or any(e["global_shape"] != glob for _, e in held):
                out.append(
                    f"{where}: pieces along dim {d} cover {pos} of {glob[d]}, or ranks disagree "
                    f"on global_shape; the manifest is damaged."
                )
    return out


_SHARED = ("encoding", "logical_shape", "quant", "kind", "expert", "tied_to")


def _group_problem(es: list[dict]) -> str | None:
    e0 = es[0]
    for k in _SHARED:
        if any(e[k] != e0[k] for e in es):
            return f"its parts disagree on '{k}'"
    by = {}
    for e in es:
        if e["part"] in by:
            return f"part '{e['part']}' is listed twice"
        by[e["part"]] = e
    enc, q, lshape = e0["encoding"], e0["quant"], e0["logical_shape"]
    if enc == "plain":
        extra = sorted(set(by) - {"weight", *ACTIVATION_PARTS})
        if "weight" not in by or extra:
            return (
                f"encoding 'plain' needs a 'weight' part and no quantization parts; the "
                f"manifest lists {sorted(by)}"
            )
        if q is not None:
            return "encoding 'plain' has quant metadata"
        w = by["weight"]
        if w["global_shape"] != lshape:
            return f"weight global_shape {w['global_shape']} != logical_shape {lshape}"
        return None
    spec = ENCODINGS.get(enc)
    if spec is None:
        return f"unknown encoding '{enc}'"
    missing = [p for p in spec.required if p not in by]
    forbidden = [p for p in spec.forbidden if p in by]
    if missing or forbidden:
        return (
            f"encoding '{enc}' needs parts {list(spec.required)} and forbids "
            f"{list(spec.forbidden)}; the manifest lists {sorted(by)}"
        )
    if q is None:
        return f"encoding '{enc}' has no quant metadata"
    w_dtype = ST_DTYPES[by["weight"]["dtype"]][0] if "weight" in by else None
    if spec.weight_dtypes is not None and w_dtype not in spec.weight_dtypes:
        return f"encoding '{enc}' cannot store its weight as {by['weight']['dtype']}"
    if len(lshape) != 2:
        return f"encoded tensors are 2-D, logical_shape is {lshape}"
    block = tuple(q["block"]) if q.get("block") else spec.default_block
    scale = by[spec.scale_part]
    try:
        scale_block(tuple(scale["global_shape"]), tuple(lshape), block)
        if spec.shape_part == "weight":
            w = by["weight"]
            if w["global_shape"] != lshape:
                return f"weight global_shape {w['global_shape']} != logical_shape {lshape}"
            scale_block(tuple(scale["shape"]), tuple(w["shape"]), block)
    except (ValueError, ArithmeticError) as err:
        return f"{spec.scale_part} does not fit the weight ({err})"
    if spec.packing == "fp4":  # the registry's geometry: bytes, scale per group, dtypes
        sig = {k: (tuple(v["global_shape"]), ST_DTYPES[v["dtype"]][0]) for k, v in by.items()}
        return spec.problem(e0["logical"], tuple(lshape), sig, QuantParams())
    if "weight_packed" in by:
        pk = by["weight_packed"]["global_shape"]
        if "weight_shape" in by and by["weight_shape"]["global_shape"] != [2]:
            return "weight_shape must hold 2 integers"
        bits = q.get("num_bits")
        words = [b for b in range(1, 9) if math.ceil(lshape[1] * b / 32) == pk[-1]] if pk else []
        if len(pk) != 2 or pk[0] != lshape[0] or (bits is None and len(words) != 1):
            return f"weight_packed global_shape {pk} does not hold logical_shape {lshape}"
        if bits is not None and math.ceil(lshape[1] * bits / 32) != pk[1]:
            return (
                f"weight_packed global_shape {pk} does not hold {bits}-bit values of "
                f"logical_shape {lshape}"
            )
    return None


# -- the unit's own header against the manifest ----------------------------------------
def check_header_layout(buf, base: int, infos: dict, u: dict, where: str) -> None:
    """Order, offsets and padding of the unit's header against the manifest's table.

    infos: the validated header (absolute offsets; names, dtypes and shapes already
    agree with the manifest). Padding fillers must be U8 zero bytes.
    """

    def bad(msg: str):
        raise StreamCorruptError(
            f"{where}: header disagrees with the manifest: {msg}; the unit or the manifest was "
            f"changed - {_FIX}."
        )

    real = sorted((t for t in infos.values() if not t.name.startswith(PAD_PREFIX)), key=_start)
    order = [t.name for t in real]
    names = [e["name"] for e in u["tensors"]]
    if order != names:
        k = next(i for i, (a, b) in enumerate(zip(order, names, strict=True)) if a != b)
        bad(f"tensor {k} in data order is '{order[k]}', the manifest lists '{names[k]}' there")
    pos = 0
    for e in u["tensors"]:
        t = infos[e["name"]]
        want = align_up(pos)
        if t.start - base != want:
            bad(f"tensor '{t.name}' starts at data offset {t.start - base}, not {want}")
        pos = want + t.nbytes
    if base + pos != len(buf):
        bad(f"{len(buf) - base - pos} bytes follow the last tensor")
    for t in infos.values():
        if t.name.startswith(PAD_PREFIX):
            if t.st_dtype != "U8" or len(t.shape) != 1:
                bad(f"padding '{t.name}' is {t.st_dtype}{list(t.shape)}, not a U8 vector")
            if bytes(buf[t.start : t.end]).count(0) != t.nbytes:
                bad(f"padding '{t.name}' holds non-zero bytes")


def _start(t) -> int:
    return t.start


# -- zstd framing -----------------------------------------------------------------------
def zstd_content_size(data, where: str) -> int:
    """The content size of the single zstd frame ``data`` must be; StreamCorruptError
    unless it is exactly one frame (content size and checksum present) with nothing
    after it. Walks the block headers only; decompresses nothing."""

    def bad(msg: str):
        raise StreamCorruptError(f"{where}: {msg}; the unit is corrupt - {_FIX}.")

    n = len(data)
    if bytes(data[:4]) != _ZSTD_MAGIC:
        bad("not a zstd frame (bad magic number; the format allows exactly one zstd frame)")
    try:
        pos = zstandard.frame_header_size(data)
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        bad(f"zstd frame header is invalid ({e})")
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        bad("zstd frame header has no content size")
    if not params.has_checksum:
        bad("zstd frame has no content checksum")
    while True:
        if pos + 3 > n:
            bad(f"zstd frame is truncated (block header at byte {pos} of {n})")
        bh = int.from_bytes(bytes(data[pos : pos + 3]), "little")
        pos += 3
        btype, size = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            bad(f"zstd block at byte {pos - 3} has the reserved block type")
        pos += 1 if btype == 1 else size
        if bh & 1:
            break
    pos += 4  # content checksum
    if pos > n:
        bad(f"zstd frame is truncated (it needs {pos} bytes, the file has {n})")
    if pos < n:
        bad(
            f"{n - pos} bytes follow the zstd frame (another frame or trailing data); a unit "
            f"is exactly one frame"
        )
    return params.content_size
