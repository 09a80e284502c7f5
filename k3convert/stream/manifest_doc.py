"""A stream's whole manifest as one document, in every format version.

Version 3 keeps each rank's unit entries in its rank file (``rankNNNNN/units.json``) and
only the rank's coordinates, ``units_file`` and ``units_bytes`` in ``manifest.json``
(spec section 4). Tools and tests that want every rank's units in one dict use
:func:`read_manifest_doc` (units inline, as in versions 1 and 2; no validation beyond
JSON) and :func:`write_manifest_doc` (the inverse: a version 3 document is split again,
rank files first, manifest.json last; a version 1 / 2 one is written as given). The
writer (``k3convert shard`` / ``convert``) commits through :func:`write_manifest_doc`
too, so what a test writes back is laid out exactly as a conversion lays it out.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.output import atomic_write, fsync_dir
from . import hashing
from .format import (
    BOUND_VERSION,
    MANIFEST,
    RANK_FORMAT,
    SPLIT_VERSION,
    dump_manifest,
    rank_units_file,
    stream_identity,
)

_SPLIT_KEYS = ("units", "units_file", "units_bytes", "units_hash")


def read_manifest_doc(root) -> dict:
    """``root/manifest.json`` with every rank's ``units`` inline (read from the rank files
    of a version 3 stream, whose rank entries then lose ``units_file`` / ``units_bytes``).
    Plain JSON, no validation: for tools and tests, not for loading a stream (that is
    :func:`k3convert.stream.open_stream`)."""
    root = Path(root)
    doc = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    for r in doc.get("ranks", []):
        if "units_file" in r and "units" not in r:
            rdoc = json.loads((root / r["units_file"]).read_text(encoding="utf-8"))
            for k in _SPLIT_KEYS:
                r.pop(k, None)
            r["units"] = rdoc["units"]
    doc.pop("stream_id", None)  # version 4: derived again when the document is written
    return doc


def split_manifest(doc: dict) -> tuple[dict, list[tuple[str, str]]]:
    """A manifest document with inline units -> (what manifest.json holds, [(rank file
    path, its text)]). Versions before 3 are returned as they are, with no rank files.
    A rank entry keeps its own ``units_file`` when it has one (the file is still written
    at the format's name for it); ``units_bytes`` is always the rank file's size. Version
    4: the stream identity (:func:`~.format.stream_identity`, under the units' hash
    algorithm) goes into manifest.json (``stream_id``, placed after ``version``) and each
    rank file (``stream``), and each rank entry records its rank file's ``units_hash``."""
    if type(doc.get("version")) is not int or doc["version"] < SPLIT_VERSION:
        return doc, []
    files: list[tuple[str, str]] = []
    algo = units_algo(u for r in doc["ranks"] for u in r.get("units") or [])
    top = _split(doc, algo, lambda i, r: r["units"],
                 lambda rel, text: files.append((rel, text)))  # fmt: skip
    return top, files


def _split(doc: dict, algo: str, units_of, emit) -> dict:
    """manifest.json's document for ``doc`` (version 3 on): each rank's units are
    ``units_of(index, rank entry)`` (not called for a rank entry without ``units``, kept
    as it is), its rank file's text handed to ``emit(rel, text)`` in rank order, one
    rank at a time."""
    bound = doc["version"] >= BOUND_VERSION
    sid = stream_identity(doc, algo) if bound else None
    ranks = []
    for i, r in enumerate(doc["ranks"]):
        if "units" not in r:
            ranks.append(r)
            continue
        rdoc = {"format": RANK_FORMAT, "version": doc["version"], "rank": i}
        if bound:
            rdoc["stream"] = sid
        rdoc["units"] = units_of(i, r)
        text = dump_manifest(rdoc)
        del rdoc
        data = text.encode("utf-8")
        rel = rank_units_file(i)
        entry = {k: v for k, v in r.items() if k not in _SPLIT_KEYS}
        entry["units_file"] = r.get("units_file", rel)
        entry["units_bytes"] = len(data)
        if bound:
            entry["units_hash"] = hashing.digest(algo, data)
        del data
        ranks.append(entry)
        emit(rel, text)
    top = {k: v for k, v in doc.items() if k != "stream_id"} | {"ranks": ranks}
    if bound:
        top = {k: top[k] for k in ("format", "version") if k in top} | {"stream_id": sid} | top
    return top


def units_algo(units) -> str:
    """The hash algorithm of the first of ``units`` (unit entries or the writer's unit
    records) that names one (a stream uses one), else the default."""
    for u in units:
        h = u.get("hash") if isinstance(u, dict) else None
        if isinstance(h, str) and h.split(":", 1)[0] in hashing.ALGORITHMS:
            return h.split(":", 1)[0]
    return hashing.DEFAULT


def write_manifest_doc(root, doc: dict, *, fsync: bool = True) -> Path:
    """Write ``doc`` (units inline) into stream directory ``root``: a version 3 document
    as its rank files (each atomically: temporary name, fsync, rename), their
    directories fsynced, then manifest.json, the commit marker, last; a version 1 / 2
    document as manifest.json alone. Rendering is deterministic (same document, same
    bytes). Returns the manifest's path."""
    root = Path(root)
    top, files = split_manifest(doc)
    top_text = dump_manifest(top)  # everything rendered (or refused) before a write
    for rel, text in files:
        _write_rank_file(root, rel, text, fsync)
    return _commit_top(root, top_text, [rel for rel, _ in files], fsync)


def write_manifest_ranks(root, doc: dict, units_of, algo: str, *, fsync: bool = True) -> Path:
    """:func:`write_manifest_doc` one rank at a time, for a version 3 / 4 document whose
    rank entries' ``units`` are placeholders: ``units_of(i)`` builds rank ``i``'s unit
    entries as its rank file is written; ``algo``: the units' hash algorithm. The same
    bytes, holding one rank's entries and one rank file's text at a time; a document
    refused while rendering leaves rank files but no manifest.json, the commit."""
    root = Path(root)
    written: list[str] = []

    def emit(rel: str, text: str) -> None:
        _write_rank_file(root, rel, text, fsync)
        written.append(rel)

    top = _split(doc, algo, lambda i, r: units_of(i), emit)
    return _commit_top(root, dump_manifest(top), written, fsync)


def _write_rank_file(root: Path, rel: str, text: str, fsync: bool) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_json(path, text, fsync=fsync)


def _commit_top(root: Path, top_text: str, written: list[str], fsync: bool) -> Path:
    """The rank files' directories fsynced, then manifest.json, the commit marker."""
    if fsync:
        for d in sorted({(root / rel).parent for rel in written}):
            fsync_dir(d)
    mp = root / MANIFEST
    atomic_json(mp, top_text, fsync=fsync)
    if fsync:
        fsync_dir(root)
    return mp


def atomic_json(path: Path, doc: dict | str, fsync: bool = True) -> None:
    """Write ``doc`` (or its ready rendering) to a temporary name, [fsync], rename."""
    atomic_write(path, doc if isinstance(doc, str) else render(doc), fsync)


def render(doc: dict) -> str:
    return dump_manifest(doc)  # == json.dumps(doc, indent=1) + "\n", faster
