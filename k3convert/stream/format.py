"""The MUSA streaming format, version 1: constants, errors and the unit byte layout.

Spec: ``formats/musa-stream-v1.md``. A unit is a plain safetensors file whose data
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
from pathlib import Path

from ..checkpoint.safetensors_io import ST_DTYPES, RawTensorInfo, parse_header_json
from ..errors import K3Error, SafetensorsFormatError

FORMAT = "musa-stream"
VERSION = 1
ALIGN = 4096
MANIFEST = "manifest.json"
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
    """manifest.json is not valid JSON or violates the schema."""


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
    for t in tensors.values():
        if (t.start % ALIGN) and not t.name.startswith(PAD_PREFIX):
            raise StreamCorruptError(
                f"{where}: tensor '{t.name}' starts at byte {t.start}, not {ALIGN}-aligned."
            )
    return base, tensors, meta


def unit_metadata(rank: int, unit: str) -> dict[str, str]:
    return {"format": FORMAT, "version": str(VERSION), "rank": str(rank), "unit": unit}


def unit_file(rank: int, index: int, unit: str, compression: str) -> str:
    return f"rank{rank:05d}/{index:04d}-{unit}{UNIT_SUFFIX[compression]}"
