"""Unit integrity hashes of the stream format, written ``ALGO:HEX``.

Version 2 manifests name each unit's hash with its algorithm (``xxh3-128:<32 hex>`` or
``sha256:<64 hex>``); version 1 manifests carry bare sha256 fields, which the reader
maps onto the same form, so everything past the manifest loader sees one shape.

Why xxh3-128 by default (measured on 2 cores, in bench/bench_shard.py): a unit's hash is
checked on every load, and sha256 runs at about 1.7 GB/s per core, below a warm
sequential read, so a verifying loader could never keep up with the disk; XXH3-128 runs
at tens of GB/s. It guards against damage (bit rot, truncation, a bad copy), which is
what a unit hash is for. It is not a defence against someone who can rewrite the
directory: they can rewrite the manifest too. The source provenance (what model hubs
publish) stays sha256, and ``shard --unit-hash sha256`` writes sha256 unit hashes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import xxhash

#: algorithm -> (hex digits, constructor of an object with update() / hexdigest())
ALGORITHMS = {
    "xxh3-128": (32, xxhash.xxh3_128),
    "sha256": (64, hashlib.sha256),
}
DEFAULT = "xxh3-128"
_RX = re.compile(r"^(xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$")


def new(algo: str):
    """A fresh hasher for ``algo`` (``update(bytes-like)``, ``hexdigest()``)."""
    return ALGORITHMS[algo][1]()


def tag(algo: str, hexdigest: str) -> str:
    return f"{algo}:{hexdigest}"


def split(value: str) -> tuple[str, str]:
    """``ALGO:HEX`` -> (algo, hex); the manifest schema has checked the form."""
    if not isinstance(value, str) or not _RX.match(value):
        raise ValueError(f"not a unit hash: {value!r}")
    algo, hexd = value.split(":", 1)
    return algo, hexd


def digest(value_algo: str, data) -> str:
    """``ALGO:HEX`` of ``data`` (any buffer) under ``value_algo`` (a name or a tagged hash,
    whose algorithm is used)."""
    algo = value_algo.split(":", 1)[0]
    h = new(algo)
    mv = memoryview(data).cast("B")  # slices of a memoryview are views, not copies
    for i in range(0, len(mv), 64 << 20):  # bounded pieces: bytes-likes of any size
        h.update(mv[i : i + (64 << 20)])
    return tag(algo, h.hexdigest())


def file_digest(path: Path, algo: str, chunk: int = 1 << 20, each=None) -> str:
    """``ALGO:HEX`` of a file, read in pieces into one reused buffer and hashed in place;
    ``each(n)`` is called after every piece (progress; it may raise to stop)."""
    h = new(algo)
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(mv):
            h.update(mv[:n])
            if each is not None:
                each(n)
    return tag(algo, h.hexdigest())
