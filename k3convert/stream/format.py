"""The MUSA streaming format, version 4: constants, errors and the unit byte layout.

Spec: ``formats/musa-stream.md``. A unit is a plain safetensors file whose data
region starts at a multiple of :data:`ALIGN` and whose every tensor starts at a
multiple of :data:`ALIGN` (gaps are filled by ``__pad__.N`` U8 tensors, because
safetensors requires the data region to be tiled without holes). That keeps units
readable by any safetensors reader while allowing O_DIRECT / GPU-direct reads of a
single tensor. Writer and reader share this module so they can never disagree.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path

from ..checkpoint.safetensors_io import ST_DTYPES, RawTensorInfo, parse_header_json
from ..errors import K3Error, SafetensorsFormatError
from . import hashing

FORMAT = "musa-stream"
VERSION = 4  # what shard writes
#: what the reader takes (1: sha256 unit hashes; 1 and 2: every rank's units inline in
#: manifest.json; 3: each rank's units in its own rank file; 4: rank files bound to their
#: manifest by a hash and the stream identity - see the spec)
READ_VERSIONS = (1, 2, 3, 4)
#: the first version whose ranks' units live in rank files, not in manifest.json
SPLIT_VERSION = 3
#: the first version whose manifest records each rank file's hash (``units_hash``) and a
#: stream identity (``stream_id``) that each rank file repeats (``stream``)
BOUND_VERSION = 4
#: the sections of manifest.json that :func:`stream_identity` covers
IDENTITY_KEYS = ("format", "version", "model", "layout", "source", "files")
#: size bounds (spec section 4.2): a version 3 / 4 manifest.json holds no unit entries, so
#: it grows with the layout (ranks, stages, expert placement) and the source file list
#: (Kimi K3 at tp8 ep8: 3.1 MB). A rank file, and a version 1 / 2 manifest, which holds
#: every rank's units, grows with its tensor entries (K3 at tp8 ep8: 47 MB per rank file;
#: its version 2 manifest, every rank's entries: 417 MB).
MAX_MANIFEST_BYTES = 64 << 20
MAX_RANK_FILE_BYTES = 512 << 20
ALIGN = 4096
MANIFEST = "manifest.json"
RANK_FORMAT = "musa-stream-rank"
JOURNAL = ".k3-journal"
PAD_PREFIX = "__pad__."
COMPRESSIONS = ("none", "zstd")
UNIT_SUFFIX = {"none": ".safetensors", "zstd": ".safetensors.zst"}


# -- errors ---------------------------------------------------------------------------
class StreamError(K3Error):
    """A stream directory cannot be used."""


class NotAStreamError(StreamError):
    """The path is not a stream directory at all (no manifest, no partial conversion)."""


class IncompleteStreamError(StreamError):
    """A conversion started but never wrote its manifest (the commit marker)."""


class StreamVersionError(StreamError):
    """The manifest is of a format version this k3convert does not read."""


class ManifestError(StreamError):
    """manifest.json is not valid JSON, violates the schema or names paths outside the
    stream: damage (exit 1), as ``shard --check`` reports it, in every verb."""

    exit_code = 1


class StreamCorruptError(StreamError):
    """A unit's bytes, size, hash or header disagree with the manifest."""

    exit_code = 1


class ShardError(K3Error):
    """A layout or split that cannot be applied to this checkpoint."""


class SplitError(ShardError):
    """A split would cut a head, a quantization group / block or a packed word."""


# -- unit byte layout -----------------------------------------------------------------
@dataclass(frozen=True)
class UnitTensor:
    """One tensor of a unit as the header describes it (offsets relative to data start)."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def align_up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


def nbytes_of(st_dtype: str, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return -(-n * ST_DTYPES[st_dtype][1] // 8)


def build_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]
) -> tuple[bytes, list[UnitTensor], int]:
    """Header bytes (length prefix included, padded so data starts at ALIGN) for
    ``(name, st_dtype, shape)`` in order; returns (prefix, placed tensors, total size).

    Placed tensors include the ``__pad__.N`` fillers, which the writer must emit as
    zero bytes.
    """
    entries: dict[str, dict] = {"__metadata__": dict(metadata)}
    placed: list[UnitTensor] = []
    pos = 0
    for name, st, shape in tensors:
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name '{name}' uses the reserved prefix {PAD_PREFIX}")
        start = align_up(pos)
        if start > pos:
            pad = UnitTensor(f"{PAD_PREFIX}{len(placed)}", "U8", (start - pos,), pos, start - pos)
            placed.append(pad)
        nb = nbytes_of(st, shape)
        placed.append(UnitTensor(name, st, tuple(int(d) for d in shape), start, nb))
        pos = start + nb
    for t in placed:
        entries[t.name] = {
            "dtype": t.st_dtype,
            "shape": list(t.shape),
            "data_offsets": [t.start, t.start + t.nbytes],
        }
    js = json.dumps(entries, separators=(",", ":"), ensure_ascii=True).encode()
    n = align_up(8 + len(js)) - 8
    prefix = struct.pack("<Q", n) + js + b" " * (n - len(js))
    return prefix, placed, len(prefix) + pos


def parse_header(head: bytes, size: int, where: str) -> tuple[int, dict[str, RawTensorInfo], dict]:
    """Validate a unit's safetensors header from its first bytes.

    head: at least the 8-byte length plus the JSON; size: the unit's raw size.
    Returns (data start, tensors by name with absolute offsets, metadata). Checks the
    safetensors rules (as the checkpoint reader does) and the format's alignment.
    """
    p = Path(where)
    if len(head) < 8:
        raise StreamCorruptError(f"{where}: unit is {len(head)} bytes, too short for a header.")
    (n,) = struct.unpack("<Q", head[:8])
    if 8 + n > len(head) or 8 + n > size:
        raise StreamCorruptError(
            f"{where}: header length {n} runs past the end of the unit; it is truncated or "
            f"corrupt - rerun `k3convert shard` to rewrite it."
        )
    base = 8 + n
    if base % ALIGN:
        raise StreamCorruptError(
            f"{where}: data region starts at {base}, not a multiple of {ALIGN}."
        )
    try:
        tensors, meta = parse_header_json(p, head[8:base], base, size)
    except SafetensorsFormatError as e:
        raise StreamCorruptError(str(e)) from e
    except (TypeError, ValueError, RecursionError, OverflowError) as e:
        # untrusted JSON of the wrong shape (a list as a dtype, 10k nested arrays, ...)
        raise StreamCorruptError(
            f"{where}: safetensors header is malformed ({type(e).__name__}: {e}); the unit is "
            f"corrupt - re-create it with `k3convert shard --force`."
        ) from e
    for t in tensors.values():
        if (t.start % ALIGN) and not t.name.startswith(PAD_PREFIX):
            raise StreamCorruptError(
                f"{where}: tensor '{t.name}' starts at byte {t.start}, not {ALIGN}-aligned."
            )
    return base, tensors, meta


def unit_metadata(rank: int, unit: str) -> dict[str, str]:
    return {"format": FORMAT, "version": str(VERSION), "rank": str(rank), "unit": unit}


def stream_identity(doc: dict, algo: str) -> str:
    """The stream's identity (version 4): ``ALGO:HEX`` of the canonical rendering
    (:func:`dump_manifest`) of the manifest's :data:`IDENTITY_KEYS` sections - what was
    converted (source files and their hashes, recipe), into which layout. ``algo``: the
    stream's unit hash algorithm, or a tagged hash whose algorithm is used."""
    text = dump_manifest({k: doc.get(k) for k in IDENTITY_KEYS})
    return hashing.digest(algo, text.encode("utf-8"))


def rank_units_file(rank: int) -> str:
    """The rank file holding rank ``rank``'s units (version 3 on), relative to the root."""
    return f"rank{rank:05d}/units.json"


def unit_file(rank: int, index: int, unit: str, compression: str) -> str:
    return f"rank{rank:05d}/{index:04d}-{unit}{UNIT_SUFFIX[compression]}"


# -- manifest rendering ---------------------------------------------------------------
def dump_manifest(doc) -> str:
    """``json.dumps(doc, indent=1, allow_nan=False) + "\\n"``, byte for byte, faster.

    The stdlib falls back to its pure-Python encoder whenever ``indent`` is set; the
    manifest of a large layout has hundreds of thousands of tokens, and it is written
    after the last unit, on the critical path. Only the types a manifest holds take the
    fast path; anything else goes through :func:`json.dumps` (same result, same errors).
    """
    parts: list[str] = []
    _dump(doc, "", parts)
    parts.append("\n")
    return "".join(parts)


_CONST = {id(None): "null", id(True): "true", id(False): "false"}


def _dump(o, ind: str, out: list[str]) -> None:
    t = type(o)
    if t is str:
        out.append(_json_str(o))
    elif t is int:
        out.append(int.__repr__(o))
    elif o is None or o is True or o is False:
        out.append(_CONST[id(o)])
    elif t is dict and all(type(k) is str for k in o):
        if not o:
            out.append("{}")
            return
        inner = ind + " "
        lead = "{\n" + inner
        sep = ",\n" + inner
        for k, v in o.items():
            tv = type(v)
            if tv is str:
                out.append(lead + _json_str(k) + ": " + _json_str(v))
            elif tv is int:
                out.append(lead + _json_str(k) + ": " + int.__repr__(v))
            elif v is None or v is True or v is False:
                out.append(lead + _json_str(k) + ": " + _CONST[id(v)])
            else:
                out.append(lead + _json_str(k) + ": ")
                _dump(v, inner, out)
            lead = sep
        out.append("\n" + ind + "}")
    elif t is list or t is tuple:
        if not o:
            out.append("[]")
            return
        inner = ind + " "
        sep = ",\n" + inner
        if all(type(x) is int for x in o):  # shapes, offsets, expert lists
            out.append("[\n" + inner + sep.join(map(int.__repr__, o)) + "\n" + ind + "]")
            return
        lead = "[\n" + inner
        for v in o:
            out.append(lead)
            _dump(v, inner, out)
            lead = sep
        out.append("\n" + ind + "]")
    else:  # floats, non-str keys, subclasses, ...: the stdlib's rendering, re-indented
        # (json.dumps never emits a raw newline inside a string, so this is exact);
        # NaN / Infinity are not JSON: refused (ValueError) instead of written bare
        out.append(json.dumps(o, indent=1, allow_nan=False).replace("\n", "\n" + ind))


def is_stream_dir(path) -> bool:
    """Whether ``path`` is a complete stream directory (its manifest, the commit marker
    written last, is there)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()
