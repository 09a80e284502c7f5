"""Reading a MUSA stream directory: validation, read-ahead, zstd, hashes, zero-copy.

``open_stream(OUT)`` validates manifest.json and the rank files holding each rank's unit
entries (JSON Schema, format version, rank / unit numbering) and that every unit file
exists with the manifest's size, so a broken or half-written directory fails before a
runtime starts; ``open_stream(OUT, ranks=[r])`` reads only rank r's rank file.
``stream.rank(r).units()`` yields one rank's units in execution order; the next
``prefetch`` units are read, hash-verified and (zstd) decompressed on a thread pool
while the caller works on the current one. Uncompressed units are memory-mapped and
their tensors are views of the mapping (zero-copy); each unit's safetensors header is
validated against the manifest before any tensor is handed out.

For a single-rank layout the :class:`Stream` itself is a runtime weight source with the
checkpoint reader's interface (``config``, ``names()``, ``meta()``, ``get()``), returning
bit-identical tensors (dequantized through the same encodings when asked).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import re
import stat
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..checkpoint import PartMeta, QuantParams, TensorMeta
from ..checkpoint.encodings import ENCODINGS, FORMATS
from ..checkpoint.output import is_unfinished_stream
from ..checkpoint.safetensors_io import ST_DTYPES, strict_json_loads
from ..errors import CheckpointError
from ..layout import Layout
from . import hashing as unit_hashing
from .carried import check_carried_file, file_digest_sha256, load_carried_config
from .consistency import check_paths, check_unit_entries, check_unit_paths, inside
from .format import (
    BOUND_VERSION,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_RANK_FILE_BYTES,
    RANK_FORMAT,
    READ_VERSIONS,
    SPLIT_VERSION,
    VERSION,
    IncompleteStreamError,
    ManifestError,
    NotAStreamError,
    StreamCorruptError,
    StreamError,
    StreamVersionError,
    nbytes_of,
    rank_units_file,
    stream_identity,
)
from .schema import validate, validate_rank_file, validate_rank_tensors
from .unit_loader import Unit, _where, check_size, load_unit


# -- manifest -------------------------------------------------------------------------
def _gc_paused(fn):
    """Run ``fn`` with the cyclic garbage collector paused: loading a manifest makes
    millions of containers (JSON, validation), none in a cycle, and the collector's
    full passes over them, as they pile up rank after rank, cost more than the work."""

    @functools.wraps(fn)
    def paused(*a, **k):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return fn(*a, **k)
        finally:
            if collecting:
                gc.enable()

    return paused


def _manifest_json(text: str, mp: Path):
    """Strict JSON (the shared loader): no key twice, no NaN / Infinity, finite numbers."""
    return strict_json_loads(text, f"{mp}: key", ManifestError, finite=True)


_FIX = "copy the stream again or re-create it with `k3convert shard --force`"
#: a manifest whose first bytes declare version 1 or 2 holds every rank's units inline:
#: it is bounded as a rank file is (the writer renders "format" then "version" first)
_LEGACY = re.compile(rb'^\s*\{\s*"format"\s*:\s*"[^"]*"\s*,\s*"version"\s*:\s*[12]\s*[,}]')


def read_bounded(path: Path, what: str, limit: int | None, expect_bytes: int | None = None):
    """The bytes of ``path`` (already checked to resolve inside the stream directory): a
    regular file, opened without following a link that appeared since (``O_NOFOLLOW`` on
    its resolved path) and without blocking on a FIFO, of at most ``limit`` bytes (None:
    :data:`MAX_MANIFEST_BYTES`, or :data:`MAX_RANK_FILE_BYTES` for a version 1 / 2
    manifest) and of ``expect_bytes`` where given. ManifestError (exit 1) otherwise,
    FileNotFoundError where it is missing; running out of memory is a ManifestError too."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path.resolve(), flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ManifestError(
            f"{path}: {what} cannot be opened ({e}); the stream is damaged - {_FIX}."
        ) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(
                f"{path}: {what} is not a regular file; the stream is damaged - {_FIX}."
            )
        if expect_bytes is not None and st.st_size != expect_bytes:
            raise ManifestError(
                f"{path}: {what} is {st.st_size} bytes but {MANIFEST} says {expect_bytes}; it is "
                f"{'truncated' if st.st_size < expect_bytes else 'damaged'} - {_FIX}."
            )
        if limit is None:
            head = os.pread(fd, 256, 0)
            limit = MAX_RANK_FILE_BYTES if _LEGACY.match(head) else MAX_MANIFEST_BYTES
        if st.st_size > limit:
            raise ManifestError(
                f"{path}: {what} is {st.st_size} bytes, above the format's bound of {limit} "
                f"bytes for it (spec section 4); the stream is damaged - {_FIX}."
            )
        chunks, n = [], 0
        while n <= limit:  # the file may have grown since fstat: never past the bound
            b = os.read(fd, min(8 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        data = b"".join(chunks)
    except MemoryError:
        raise ManifestError(
            f"{path}: the {what} ({st.st_size} bytes) does not fit in the memory available; "
            f"the stream is damaged, or raise the process's memory limit."
        ) from None
    except OSError as e:
        raise ManifestError(
            f"{path}: {what} cannot be read ({e}); the stream is damaged - {_FIX}."
        ) from e
    finally:
        os.close(fd)
    if n > limit or (expect_bytes is not None and n != expect_bytes):
        raise ManifestError(
            f"{path}: {what} changed while it was read; the stream is damaged - {_FIX}."
        )
    return data


def _parse_json(data: bytes, path: Path, what: str):
    """Strict JSON of ``data``; ManifestError naming ``path`` when it is not, or when it
    does not fit in the memory available."""
    try:
        return _manifest_json(data.decode("utf-8"), path)
    except ManifestError:
        raise
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ManifestError(f"{path}: not valid JSON ({e}); the {what} is damaged.") from e
    except RecursionError:
        raise ManifestError(
            f"{path}: not valid JSON (nested too deeply); the {what} is damaged."
        ) from None
    except MemoryError:
        raise ManifestError(
            f"{path}: the {what} ({len(data)} bytes) does not fit in the memory available; "
            f"the stream is damaged, or raise the process's memory limit."
        ) from None


def _read_json(path: Path, what: str, expect_bytes: int | None = None, expect_hash=None, rank=None):
    """(``path`` (a rank file) parsed as strict JSON, the BLAKE2b of its bytes), after
    :func:`read_bounded` and, where given, a check of its bytes against ``expect_hash``
    (``ALGO:HEX``); ManifestError naming it when it is missing, unreadable, over the bound,
    of another size or hash than the manifest records, or not valid JSON."""
    try:
        data = read_bounded(path, what, MAX_RANK_FILE_BYTES, expect_bytes)
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: {what} is missing while {MANIFEST} (written after it) is present; the "
            f"stream is damaged - {_FIX}."
        ) from None
    if expect_hash is not None and unit_hashing.digest(expect_hash, data) != expect_hash:
        raise ManifestError(
            f"{path}: {what} of rank {rank} does not belong to this stream: its hash differs "
            f"from the one {MANIFEST} records ({expect_hash}); it was replaced (a rank "
            f"directory from another conversion?) or damaged - {_FIX}."
        )
    return _parse_json(data, path, what), hashlib.blake2b(data, digest_size=32).digest()


def _one_hash_form(doc: dict, i: int, where: Path) -> None:
    """Give every unit of rank ``i`` ``hash`` / ``raw_hash`` as ``ALGO:HEX`` and its format
    version, so that nothing past this point depends on the version: version 1 units
    carry bare sha256 fields (``sha256``, ``raw_sha256``), later versions tagged ones.
    A stream uses one hash algorithm: checked against every other rank loaded so far."""
    v = doc["version"]
    algos: set[str] = set()
    for j, u in enumerate(doc["ranks"][i]["units"]):
        v1 = "sha256" in u or "raw_sha256" in u
        v2 = "hash" in u or "raw_hash" in u
        if (v == 1 and (v2 or not v1)) or (v >= 2 and (v1 or not v2)):
            want = "sha256 and raw_sha256" if v == 1 else "hash and raw_hash"
            found = sorted(k for k in ("hash", "raw_hash", "sha256", "raw_sha256") if k in u)
            raise ManifestError(
                f"{where}: ranks[{i}].units[{j}]: a version {v} unit must record only {want}, "
                f"found {', '.join(found) or 'none'}; the manifest is damaged or was "
                f"edited by hand."
            )
        if v == 1:
            u["hash"] = unit_hashing.tag("sha256", u.pop("sha256"))
            u["raw_hash"] = unit_hashing.tag("sha256", u.pop("raw_sha256"))
        u["_version"] = v
        algos.update(h.split(":", 1)[0] for h in (u["hash"], u["raw_hash"]))
    for k, r in enumerate(doc["ranks"]):  # the units of every rank loaded before this one
        if len(algos) > 1:
            break
        if k != i and r.get("units") and "_version" in r["units"][0]:
            algos.add(r["units"][0]["hash"].split(":", 1)[0])
    if len(algos) > 1:
        raise ManifestError(
            f"{where}: units use more than one hash algorithm ({', '.join(sorted(algos))}); a "
            f"stream uses one - the manifest is damaged or was edited by hand."
        )


def _read_manifest(root: Path) -> tuple[Path, dict]:
    """``root/manifest.json`` parsed, with its format and version checked."""
    if not root.is_dir():
        raise NotAStreamError(f"{root}: not a directory; expected a k3convert stream directory.")
    mp = root / MANIFEST
    if not mp.is_file():
        if is_unfinished_stream(root):
            raise IncompleteStreamError(
                f"{root}: incomplete conversion - {MANIFEST} is missing (it is written last, "
                f"as the commit marker): the shard / convert run was interrupted, or the "
                f"manifest was lost. Rerun `k3convert shard` / `convert` with the same "
                f"arguments to resume it, or copy the stream again."
            )
        raise NotAStreamError(
            f"{root}: not a stream directory (no {MANIFEST}); create one with `k3convert shard`."
        )
    mp = inside(root, MANIFEST, "the manifest")  # a link is followed only inside the stream
    try:
        data = read_bounded(mp, "manifest", None)
    except FileNotFoundError:  # removed since is_file()
        raise NotAStreamError(f"{root}: not a stream directory (no {MANIFEST}).") from None
    doc = _parse_json(data, mp, "manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NotAStreamError(f"{mp}: not a {FORMAT} manifest (format key is missing or wrong).")
    if type(doc.get("version")) is not int or doc.get("version") not in READ_VERSIONS:
        raise StreamVersionError(
            f"{mp}: {FORMAT} version {doc.get('version')!r} is not supported; this k3convert "
            f"reads versions {', '.join(map(str, READ_VERSIONS))}. Use a matching k3convert "
            f"or re-shard the model."
        )
    return mp, doc


def _schema_error(where: Path, errs: list[str], what: str = "manifest") -> ManifestError:
    more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
    return ManifestError(f"{where}: violates the {what} schema: {'; '.join(errs[:5])}{more}.")


@_gc_paused
def load_manifest(root: Path, ranks=None) -> dict:
    """Parse and validate ``root/manifest.json`` (schema, version, numbering) and the
    unit entries of ``ranks`` (None: every rank, as ``shard --check`` does).

    Version 3: each rank's units are in its rank file (``rankNNNNN/units.json``); only
    the files of ``ranks`` are read here, and the rank entries of the others get no
    ``units`` until :func:`check_rank` loads them. Versions 1 and 2 (units inline): every
    rank's and unit's own fields and numbering are checked, the tensor entries of
    ``ranks`` only. Either way, once loaded, a rank has ``units`` (the same entries in
    every version) and has passed the same checks."""
    mp, doc = _read_manifest(root)
    try:
        errs = validate(doc, ranks=None if ranks is None else set(ranks))
    except RecursionError:
        errs = ["nested too deeply"]
    if errs:
        raise _schema_error(mp, errs)
    lay = doc["layout"]
    if lay["tp"] * lay["pp"] != lay["world"] or len(doc["ranks"]) != lay["world"]:
        raise ManifestError(f"{mp}: layout.world / ranks disagree with tp * pp.")
    if lay["moe_tp"] * lay["moe_ep"] != lay["tp"]:
        raise ManifestError(f"{mp}: layout moe_tp * moe_ep != tp.")
    stages = {s["pp_rank"]: s["units"] for s in lay["stages"]}
    if sorted(stages) != list(range(lay["pp"])) or len(lay["stages"]) != lay["pp"]:
        raise ManifestError(
            f"{mp}: layout.stages must list pp_rank 0 .. {lay['pp'] - 1} once each."
        )
    split = doc["version"] >= SPLIT_VERSION
    for i, r in enumerate(doc["ranks"]):
        if (
            r["rank"] != i
            or r["pp_rank"] * lay["tp"] + r["tp_rank"] != i
            or r["tp_rank"] >= lay["tp"]
            or r["ep_rank"] * lay["moe_tp"] + r["moe_tp_rank"] != r["tp_rank"]
            or r["moe_tp_rank"] >= lay["moe_tp"]
        ):
            raise ManifestError(f"{mp}: ranks[{i}] is numbered {r['rank']} / inconsistent.")
        if split and r["units_file"] != rank_units_file(i):
            raise ManifestError(
                f"{mp}: ranks[{i}].units_file {r['units_file']!r} is not the format's name "
                f"for it ({rank_units_file(i)!r}); the manifest is damaged or was edited, "
                f"re-create the stream with `k3convert shard --force`."
            )
    check_paths(doc, mp)  # carried files
    if doc["version"] >= BOUND_VERSION:
        sid = stream_identity(doc, doc["stream_id"])
        if sid != doc["stream_id"]:
            raise ManifestError(
                f"{mp}: stream_id {doc['stream_id']} is not the identity of this manifest's "
                f"model / layout / source / files sections ({sid}); the manifest was edited "
                f"or damaged - {_FIX}."
            )
    if split:
        for i in range(len(doc["ranks"])) if ranks is None else ranks:
            if 0 <= i < len(doc["ranks"]):
                _load_rank_units(root, doc, i)
    else:
        for i in range(len(doc["ranks"])):
            _check_rank_units(doc, i, mp, owners=ranks is None or i in ranks)
    return doc


#: (BLAKE2b of the bytes, rank) of the rank files this process found valid against the
#: schema: the same bytes are not walked again (``check`` then ``open_stream`` in one
#: ``verify``)
_SCHEMA_VALID: set[tuple[bytes, int]] = set()


def _load_rank_units(root: Path, doc: dict, i: int) -> None:
    """Version 3: read rank ``i``'s rank file into ``doc["ranks"][i]["units"]``, after
    checking its path, size, JSON, format, version, rank, schema and numbering."""
    r = doc["ranks"][i]
    path = inside(root, r["units_file"], f"rank {i}'s units file")  # before it is opened
    rdoc, digest = _read_json(path, "rank file", r["units_bytes"], r.get("units_hash"), rank=i)
    if not isinstance(rdoc, dict) or rdoc.get("format") != RANK_FORMAT:
        raise ManifestError(
            f"{path}: not a {RANK_FORMAT} file (format key is missing or wrong); the stream "
            f"is damaged - re-create it with `k3convert shard --force`."
        )
    if type(rdoc.get("version")) is not int or rdoc["version"] != doc["version"]:
        raise ManifestError(
            f"{path}: rank file version {rdoc.get('version')!r} differs from {MANIFEST}'s "
            f"{doc['version']}; the stream is damaged or mixes two conversions - re-create "
            f"it with `k3convert shard --force`."
        )
    if type(rdoc.get("rank")) is not int or rdoc["rank"] != i:
        raise ManifestError(
            f"{path}: rank file is for rank {rdoc.get('rank')!r}, not {i}; the stream is "
            f"damaged - re-create it with `k3convert shard --force`."
        )
    if doc["version"] >= BOUND_VERSION and rdoc.get("stream") != doc["stream_id"]:
        raise ManifestError(
            f"{path}: rank file belongs to stream {rdoc.get('stream')!r}, not to this one "
            f"({doc['stream_id']}); rank {i}'s directory comes from another conversion - {_FIX}."
        )
    if (digest, i) not in _SCHEMA_VALID:
        try:
            errs = validate_rank_file(rdoc, i)
        except RecursionError:
            errs = ["nested too deeply"]
        if errs:
            raise _schema_error(path, errs, "rank file")
        if len(_SCHEMA_VALID) >= 4096:
            _SCHEMA_VALID.clear()
        _SCHEMA_VALID.add((digest, i))
    units = rdoc["units"]
    _share_values(units)
    r["units"] = units
    try:
        _check_rank_units(doc, i, path, owners=True)
    except BaseException:
        del r["units"]  # not loaded: a later use reports it again
        raise


#: tensor entry fields whose values repeat across a rank's entries (strings, shape
#: lists, quant objects): one object each, shared by the entries that hold it
_SHARED_STR = ("logical", "part", "kind", "dtype", "encoding", "contents")
_SHARED_LIST = ("shape", "global_shape", "logical_shape")


def _share_values(units: list) -> None:
    """Make equal field values of a rank's tensor entries one object (a rank of Kimi K3
    at tp8 ep8 lists ~70k entries whose shapes, encodings and quant metadata repeat by
    expert): the parsed rank file then takes less than half the memory (done as each
    rank file is loaded, after the schema has checked every value: a stream opened whole
    holds every rank's entries at once). Entries are read-only from then on."""
    strs, lists, quants = {}, {}, {}
    for u in units:
        for e in u["tensors"]:
            for k in _SHARED_STR:
                v = e.get(k)
                if v is not None:
                    e[k] = strs.setdefault(v, v)
            for k in _SHARED_LIST:
                v = e.get(k)
                if v is not None:
                    e[k] = lists.setdefault(tuple(v), v)
            q = e.get("quant")
            if q is not None:
                e["quant"] = quants.setdefault(repr(q), q)


def _check_rank_units(doc: dict, i: int, where: Path, *, owners: bool) -> None:
    """Rank ``i``'s units: hash form, names against its stage, numbering, file names;
    with ``owners``, the one-unit-per-logical rule (its tensor entries are checked)."""
    _one_hash_form(doc, i, where)
    lay = doc["layout"]
    stages = {s["pp_rank"]: s["units"] for s in lay["stages"]}
    r = doc["ranks"][i]
    if [u["name"] for u in r["units"]] != stages[r["pp_rank"]]:
        raise ManifestError(
            f"{where}: ranks[{i}] units differ from layout.stages[{r['pp_rank']}].units."
        )
    for j, u in enumerate(r["units"]):
        if u["index"] != j:
            raise ManifestError(f"{where}: ranks[{i}].units[{j}] has index {u['index']}.")
        num = u["name"].partition(".")[2]
        if len(num) > 9:
            raise ManifestError(f"{where}: ranks[{i}].units[{j}] has a unit name too long.")
        if u["layer"] != (int(num) if num else None):
            raise ManifestError(
                f"{where}: ranks[{i}].units[{j}] ('{u['name']}') has layer {u['layer']}."
            )
    check_unit_paths(r, where)
    if owners:
        _check_owners(r, where)


def _check_owners(r: dict, mp: Path) -> None:
    """One logical tensor of a rank lives in one unit."""
    owner: dict[str, str] = {}
    for u in r["units"]:
        for e in u["tensors"]:
            if owner.setdefault(e["logical"], u["name"]) != u["name"]:
                raise StreamCorruptError(
                    f"{mp}: rank {r['rank']}: logical tensor '{e['logical']}' is in units "
                    f"'{owner[e['logical']]}' and '{u['name']}'; one logical tensor lives "
                    f"in one unit - the manifest is damaged or was edited."
                )


@_gc_paused
def check_rank(root: Path, doc: dict, i: int, *, entries: bool = True) -> None:
    """What opening rank ``i`` needs beyond :func:`load_manifest` ``(ranks=...)``: its
    units' entries against the geometry rules and their files' sizes; with ``entries``
    (when :func:`load_manifest` was given other ranks), first its unit entries: a
    version 3 rank file is read and checked in full now, inline entries have their
    tensor entries checked against the schema and the one-unit-per-logical rule."""
    r = doc["ranks"][i]
    if entries:
        if "units" not in r:
            _load_rank_units(root, doc, i)
        else:
            errs = validate_rank_tensors(doc, i)
            if errs:
                raise _schema_error(root / MANIFEST, errs)
            _check_owners(r, root / MANIFEST)
    for u in r["units"]:
        check_unit_entries(u, manifest_where(root, i, u))
        check_size(root, i, u)


def manifest_where(root: Path, rank: int, u: dict) -> str:
    src = rank_units_file(rank) if u.get("_version", VERSION) >= SPLIT_VERSION else MANIFEST
    return f"{root / src} (rank {rank}, unit '{u['name']}', file {u['file']})"


# -- readers --------------------------------------------------------------------------
def quant_params_of(q: dict | None, encoding: str) -> QuantParams:
    """A manifest entry's quant metadata, with the encoding's default block applied."""
    q = q or {}
    default = ENCODINGS[encoding].default_block if encoding in ENCODINGS else None
    return QuantParams(
        num_bits=q.get("num_bits"),
        block=tuple(q["block"]) if q.get("block") else default,
        symmetric=q.get("symmetric"),
        extra={"strategy": q.get("strategy"), "type": q.get("type")} if q else {},
    )


def part_meta(e: dict, path: Path, shape_key: str) -> PartMeta:
    """A manifest tensor entry as a PartMeta: ``shape_key`` "shape" (as stored on its
    rank) or "global_shape" (the whole part)."""
    shape = tuple(e[shape_key])
    return PartMeta(e["name"], path, ST_DTYPES[e["dtype"]][0], shape, nbytes_of(e["dtype"], shape))


class RankReader:
    """One rank's view: its units in execution order, and its local tensors by name."""

    def __init__(self, stream: Stream, rank: int):
        self.stream, self.rank = stream, rank
        self.info = stream.manifest["ranks"][rank]
        self.unit_entries: list[dict] = self.info["units"]
        self._index: dict[str, tuple[int, list[dict]]] = {}
        for i, u in enumerate(self.unit_entries):
            for e in u["tensors"]:
                self._index.setdefault(e["logical"], (i, []))[1].append(e)
        self._cache: OrderedDict[int, Unit] = OrderedDict()
        self._verified: set[int] = set()

    def __repr__(self) -> str:
        return f"RankReader(rank={self.rank}, units={len(self.unit_entries)})"

    @property
    def coords(self) -> dict[str, int]:
        return {k: self.info[k] for k in ("pp_rank", "tp_rank", "ep_rank", "moe_tp_rank")}

    def unit_names(self) -> list[str]:
        return [u["name"] for u in self.unit_entries]

    def release(self) -> None:
        """Drop the units kept for ``get`` (their mappings or decompressed bytes)."""
        self._cache.clear()

    def unit(self, which: int | str, *, verify_hashes: bool | None = None) -> Unit:
        names = self.unit_names()
        if isinstance(which, int) and -len(names) <= which < len(names):
            i = which
        elif isinstance(which, str) and which in names:
            i = names.index(which)
        else:
            raise StreamError(
                f"{self.stream.root}: rank {self.rank} has no unit {which!r}; its units are "
                f"{names}."
            )
        v = self.stream.verify_hashes if verify_hashes is None else verify_hashes
        return load_unit(self.stream.root, self.rank, self.unit_entries[i], v)

    def units(self, *, prefetch: int = 2, verify_hashes: bool | None = None) -> Iterator[Unit]:
        """The rank's units in order, reading ``prefetch`` ahead on a thread pool."""
        v = self.stream.verify_hashes if verify_hashes is None else verify_hashes
        ents = self.unit_entries
        if prefetch < 1:
            for u in ents:
                yield load_unit(self.stream.root, self.rank, u, v)
            return
        pool = ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="k3stream")
        window: deque = deque()
        try:
            nxt = 0
            while nxt < len(ents) or window:
                while nxt < len(ents) and len(window) <= prefetch:
                    window.append(pool.submit(load_unit, self.stream.root, self.rank, ents[nxt], v))
                    nxt += 1
                yield window.popleft().result()
        finally:
            for f in window:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    # -- weight-source interface over the rank's local tensors --------------------------
    def names(self, *, include_tied: bool = False) -> list[str]:
        return [n for n, (_, es) in self._index.items() if include_tied or not es[0]["tied_to"]]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def _entries(self, name: str) -> tuple[int, list[dict]]:
        try:
            return self._index[name]
        except KeyError:
            raise CheckpointError(
                f"{self.stream.root}: rank {self.rank} holds no tensor named '{name}'."
            ) from None

    def _load(self, i: int) -> Unit:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        u = self.unit_entries[i]
        verify = self.stream.verify_hashes and i not in self._verified
        unit = load_unit(self.stream.root, self.rank, u, verify)
        self._verified.add(i)
        self._cache[i] = unit
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return unit

    def meta(self, name: str) -> TensorMeta:
        """Local metadata (shapes as stored on this rank)."""
        i, es = self._entries(name)
        path = self.stream.root / self.unit_entries[i]["file"]
        parts = {e["part"]: part_meta(e, path, "shape") for e in es}
        e0 = es[0]
        shape = tuple(e0["logical_shape"])
        if any(e["split_dim"] is not None or e["contents"] == "local_shape" for e in es):
            shape = self._local_shape(name, es)
        return TensorMeta(
            name, shape, e0["encoding"], parts, quant_params_of(e0["quant"], e0["encoding"])
        )

    def _local_shape(self, name: str, es: list[dict]) -> tuple[int, ...]:
        by = {e["part"]: e for e in es}
        if "weight_shape" in by:
            return tuple(int(x) for x in self.get_parts(name)["weight_shape"].tolist())
        enc = FORMATS.get(es[0]["encoding"])
        sig = {p: (tuple(e["shape"]), None) for p, e in by.items()}
        shape = enc.stored_shape(sig) if enc is not None else None
        return shape if shape is not None else tuple(by["weight"]["shape"])

    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        i, es = self._entries(name)
        unit = self._load(i)
        return {e["part"]: unit.tensors[e["name"]] for e in es}

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One local tensor, dequantized if encoded (float32 unless ``dtype``)."""
        i, es = self._entries(name)
        enc = es[0]["encoding"]
        parts = self.get_parts(name)
        if enc == "plain":
            t = parts["weight"]
            return t if dtype is None or t.dtype == dtype else t.to(dtype)
        try:
            w = ENCODINGS[enc].dequantize_to(parts, quant_params_of(es[0]["quant"], enc), dtype)
        except (ValueError, ArithmeticError, RuntimeError, LookupError, TypeError) as e:
            u = self.unit_entries[i]
            raise StreamCorruptError(
                f"{_where(self.rank, u, self.stream.root / u['file'])}: cannot dequantize "
                f"'{name}' ({enc}): {e}; its parts do not fit their manifest entry - "
                f"re-create the stream with `k3convert shard --force`."
            ) from e
        return w.to(dtype or torch.float32)


class Stream:
    """An opened, validated stream directory. Build it with :func:`open_stream`."""

    def __init__(
        self, root: Path, manifest: dict, verify_hashes: bool = True, checked=None
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.verify_hashes = verify_hashes
        lay = manifest["layout"]
        self.layout = Layout(lay["tp"], lay["pp"], lay["moe_tp"], lay["moe_ep"])
        #: config.json as the conversion carried it: its bytes checked against the
        #: manifest's size and sha256 (``files``), then parsed from those same bytes
        self.config: dict = load_carried_config(root, manifest)
        self._ranks: dict[int, RankReader] = {}
        #: ranks whose entries and unit files are checked (None: all of them)
        self._checked: set[int] | None = None if checked is None else set(checked)
        self._names: list[str] | None = None
        self._name_set: set[str] = set()

    def __repr__(self) -> str:
        lay = self.layout
        return f"Stream({str(self.root)!r}, tp={lay.tp}, pp={lay.pp}, ep={lay.moe_ep})"

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def aux_files(self) -> list[Path]:
        return [inside(self.root, f["name"], "carried file") for f in self.manifest["files"]]

    def check_carried(self) -> None:
        """Every carried file (config, tokenizer, ...) is the one the manifest records
        (size and sha256); the first that is not raises StreamCorruptError naming it. For
        a consumer about to read carried files beyond config.json (``forward``'s
        tokenizer), which :func:`open_stream` already checks."""
        for f in self.manifest["files"]:
            p = inside(self.root, f["name"], "carried file")
            check_carried_file(p, f, file_digest_sha256(p))

    def rank(self, r: int) -> RankReader:
        if not 0 <= r < self.world:
            raise StreamError(f"{self.root}: rank {r} is outside the world of {self.world}.")
        if self._checked is not None and r not in self._checked:
            check_rank(self.root, self.manifest, r)  # opened for other ranks: check it now
            self._checked.add(r)
        if r not in self._ranks:
            self._ranks[r] = RankReader(self, r)
        return self._ranks[r]

    # -- single-rank weight source ------------------------------------------------------
    def _single(self) -> RankReader:
        if self.world != 1:
            raise StreamError(
                f"{self.root}: a {self.layout.tp}x{self.layout.pp} (tp x pp) stream has no "
                f"single set of global tensors; use stream.rank(r) for one rank's tensors."
            )
        return self.rank(0)

    def names(self) -> list[str]:
        """Logical tensor names (tied lm_head copies left out, as in the checkpoint)."""
        if self._names is None:
            self._names = self._single().names()
            self._name_set = set(self._names)
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        if self._names is None:
            self.names()
        return name in self._name_set  # no list copy: called once per tensor

    def meta(self, name: str) -> TensorMeta:
        if name not in self:
            raise CheckpointError(f"{self.root}: no tensor named '{name}'.")
        return self._single().meta(name)

    def get_parts(self, name: str) -> dict[str, torch.Tensor]:
        return self._single().get_parts(name)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self:
            raise CheckpointError(f"{self.root}: no tensor named '{name}'.")
        return self._single().get(name, dtype)

    def iter_tensors(self, dtype=None):
        for n in self.names():
            yield n, self.get(n, dtype)


def _rank_list(ranks) -> list[int]:
    """``open_stream``'s ``ranks``: a sequence (list, tuple, range) of ints, sorted and
    deduplicated; a string, a float, a bool or a single int is a caller's mistake, refused
    (``ranks="01"`` is not ranks 0 and 1, ``[0.5]`` is not rank 0)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"open_stream: ranks must be a list of ints, got {ranks!r}")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise TypeError(f"open_stream: ranks must be ints, got {bad[0]!r} in {ranks!r}")
    return sorted(set(ranks))


def open_stream(path, *, verify_hashes: bool = True, ranks=None) -> Stream:
    """Open and validate a stream directory (its manifest; units when used).

    ``ranks``: the rank indices this process reads (None: all). Their unit entries (a
    version 3 stream: their rank files; nothing else of another rank is read) and unit
    files are checked now, with the manifest's header and numbering; any other rank is
    loaded and checked the first time ``rank(r)`` is asked for, so the work of opening a
    rank is proportional to the ranks opened, not to the world (a version 1 / 2 stream
    still has every rank's units in the one manifest.json to parse)."""
    root = Path(path)
    if ranks is not None:
        ranks = _rank_list(ranks)
    manifest = load_manifest(root, ranks)
    world = len(manifest["ranks"])
    if ranks is not None and any(not 0 <= r < world for r in ranks):
        raise StreamError(f"{root}: ranks {ranks} are not all inside the world of {world}.")
    for i in range(world) if ranks is None else ranks:
        check_rank(root, manifest, i, entries=False)
    return Stream(root, manifest, verify_hashes, checked=ranks)
