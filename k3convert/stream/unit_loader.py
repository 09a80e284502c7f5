"""Loading one unit file of a stream: its size, hash, zstd frame and safetensors header
checked against the manifest, its tensors handed out as views of one buffer (a
memory mapping for uncompressed units: zero-copy)."""

from __future__ import annotations

import hashlib
import mmap
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zstandard

from ..checkpoint.safetensors_io import ST_DTYPES
from . import hashing as unit_hashing
from .consistency import check_header_layout, inside, zstd_content_size
from .format import FORMAT, PAD_PREFIX, VERSION, StreamCorruptError, StreamError, parse_header


@dataclass
class Unit:
    """One loaded unit of one rank: tensors by physical name (views of one buffer)."""

    rank: int
    index: int
    name: str
    layer: int | None
    file: Path
    entries: list[dict]
    tensors: Mapping[str, torch.Tensor] = field(repr=False)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def parts(self, logical: str) -> dict[str, torch.Tensor]:
        """The parts of one logical tensor ('weight', 'weight_scale', ...)."""
        return {e["part"]: self.tensors[e["name"]] for e in self.entries if e["logical"] == logical}


def _where(rank: int, u: dict, path: Path) -> str:
    return f"{path} (rank {rank}, unit '{u['name']}')"


def check_size(root: Path, rank: int, u: dict) -> Path:
    path = inside(root, u["file"], f"rank {rank}, unit '{u['name']}'")
    try:
        size = path.stat().st_size
    except OSError:
        raise StreamCorruptError(
            f"{_where(rank, u, path)}: unit file is missing; re-create the stream with "
            f"`k3convert shard --force`."
        ) from None
    if size != u["bytes"]:
        raise StreamCorruptError(
            f"{_where(rank, u, path)}: unit is {size} bytes but the manifest says {u['bytes']}; "
            f"the file is {'truncated' if size < u['bytes'] else 'damaged'} - re-create it "
            f"with `k3convert shard --force`."
        )
    return path


def _hash_error(rank, u, path, which, want, got) -> StreamCorruptError:
    """``want`` / ``got``: ``ALGO:HEX``; ``which``: whose bytes ('' or 'uncompressed ')."""
    algo, w = want.split(":", 1)
    g = got.split(":", 1)[1]
    return StreamCorruptError(
        f"{_where(rank, u, path)}: {which}{algo} hash mismatch (manifest {w[:16]}..., file "
        f"{g[:16]}...); the unit is corrupt - re-create it with `k3convert shard --force`."
    )


def read_unit_bytes(root: Path, rank: int, u: dict, verify: bool, full: bool = False):
    """The unit's raw safetensors bytes (an mmap or a bytearray), verified on request.

    ``u`` must have passed :func:`check_unit_entries` (``open_stream`` checks every unit
    once; ``check`` each unit before reading it), so ``raw_bytes`` is bounded by the
    tensor table before anything is allocated. ``full`` also checks the uncompressed
    size / hash of zstd units.
    """
    path = check_size(root, rank, u)
    where = _where(rank, u, path)
    try:
        if u["compression"] == "none":
            with open(path, "rb") as fh:
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        else:
            buf = path.read_bytes()
    except (OSError, ValueError) as e:
        raise StreamCorruptError(f"{where}: cannot read the unit ({e}).") from e
    if len(buf) != u["bytes"]:  # changed since check_size
        raise StreamCorruptError(
            f"{where}: unit is {len(buf)} bytes but the manifest says {u['bytes']}; re-create "
            f"it with `k3convert shard --force`."
        )
    if u["compression"] == "none":
        if verify:
            got = unit_hashing.digest(u["hash"], buf)
            if got != u["hash"]:
                raise _hash_error(rank, u, path, "", u["hash"], got)
        elif hasattr(buf, "madvise"):
            buf.madvise(mmap.MADV_WILLNEED)
        return buf, path
    data = buf
    if verify:
        got = unit_hashing.digest(u["hash"], data)
        if got != u["hash"]:
            raise _hash_error(rank, u, path, "", u["hash"], got)
    # never trust the frame's claim: it must match raw_bytes, which must match the
    # manifest's tensor table (check_unit_entries), before anything is allocated
    size = zstd_content_size(data, where)
    if size != u["raw_bytes"]:
        raise StreamCorruptError(
            f"{where}: zstd frame claims {size} bytes of content but the manifest's raw_bytes "
            f"is {u['raw_bytes']}; the unit is corrupt - re-create it with `k3convert shard "
            f"--force`."
        )
    try:
        raw = bytearray(u["raw_bytes"])
    except MemoryError:
        raise StreamError(
            f"{where}: unit needs {u['raw_bytes'] / 2**30:.1f} GiB of memory to decompress, "
            f"more than is available; free memory or re-shard with compression 'none'."
        ) from None
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as r:
            n, mv = 0, memoryview(raw)
            while n < len(raw):
                k = r.readinto(mv[n:])
                if not k:
                    break
                n += k
            extra = r.read(1)
    except (zstandard.ZstdError, ValueError) as e:
        raise StreamCorruptError(
            f"{where}: zstd data is corrupt ({e}); re-create it with `k3convert shard --force`."
        ) from e
    if n != len(raw) or extra:
        raise StreamCorruptError(
            f"{where}: decompresses to a different size than the manifest's raw_bytes "
            f"{u['raw_bytes']}; the unit is corrupt - re-create it with `k3convert shard --force`."
        )
    if full:
        got = unit_hashing.digest(u["raw_hash"], raw)
        if got != u["raw_hash"]:
            raise _hash_error(rank, u, path, "uncompressed ", u["raw_hash"], got)
    return raw, path


def header_of(buf, rank: int, u: dict, path: Path, root: Path):
    """Validate the unit's header against the format and the manifest; tensor infos.

    ``u`` has passed :func:`check_unit_entries` (see :func:`read_unit_bytes`); checks
    the header: metadata, names, dtypes, shapes, order, offsets, padding.
    """
    where = _where(rank, u, path)
    if len(buf) < 8:
        raise StreamCorruptError(f"{where}: unit is too short for a safetensors header.")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    head = bytes(buf[: min(len(buf), 8 + n)])
    version = str(u.get("_version", VERSION))
    key, seen = (str(path), rank), (hashlib.blake2b(head, digest_size=32).digest(), len(buf))
    with _PARSED_LOCK:
        hit = _PARSED.get(key)
    if hit is not None and hit[0] == seen:
        base, infos, meta = hit[1]
    else:
        base, infos, meta = parse_header(head, len(buf), where)
        with _PARSED_LOCK:
            _PARSED.pop(key, None)
            _PARSED[key] = (seen, (base, infos, meta))
            while len(_PARSED) > 1 and (
                len(_PARSED) > _PARSED_UNITS
                or sum(len(v[1][1]) for v in _PARSED.values()) > _PARSED_TENSORS
            ):
                _PARSED.popitem(last=False)
    want_meta = {"format": FORMAT, "version": version, "rank": str(rank), "unit": u["name"]}
    if {k: meta.get(k) for k in want_meta} != want_meta:
        raise StreamCorruptError(
            f"{where}: header metadata {meta} disagrees with the manifest (expected {want_meta})."
        )
    real = [k for k in infos if not k.startswith(PAD_PREFIX)]
    names = [e["name"] for e in u["tensors"]]
    if sorted(real) != sorted(names):
        missing = sorted(set(names) - set(real))
        extra = sorted(set(real) - set(names))
        raise StreamCorruptError(
            f"{where}: header disagrees with the manifest: missing {missing[:3]}, "
            f"unexpected {extra[:3]}."
        )
    for e in u["tensors"]:
        t = infos[e["name"]]
        if t.st_dtype != e["dtype"] or list(t.shape) != e["shape"]:
            raise StreamCorruptError(
                f"{where}: header disagrees with the manifest for tensor '{e['name']}': header "
                f"{t.st_dtype}{list(t.shape)}, manifest {e['dtype']}{e['shape']}."
            )
    check_header_layout(buf, base, infos, u, where)
    return infos


#: (unit path, rank) -> ((BLAKE2b of the header bytes, unit size), :func:`parse_header`'s
#: result) of the units whose header parsed last: a unit read again (``verify`` checks the
#: stream, runs the forward, then the decode check) with the same header bytes and size
#: parses the same (a function of those two); the checks against the manifest and the
#: padding are run again. At most :data:`_PARSED_UNITS` units holding at most
#: :data:`_PARSED_TENSORS` tensors between them (about 400 bytes each): a small stream is
#: parsed once; Kimi K3 at tp8 pp2 (768 units, 0.8 M tensors at its full count, 0.33 GB
#: parsed) parses each unit again, 2.7 s per pass over the stream on one core.
_PARSED: OrderedDict[tuple[str, int], tuple] = OrderedDict()
_PARSED_UNITS = 1024
_PARSED_TENSORS = 1 << 16
_PARSED_LOCK = threading.Lock()


def load_unit(root: Path, rank: int, u: dict, verify: bool = True) -> Unit:
    buf, path = read_unit_bytes(root, rank, u, verify)
    infos = header_of(buf, rank, u, path, root)
    views = _Views(
        torch.frombuffer(buf, dtype=torch.uint8), infos, [e["name"] for e in u["tensors"]]
    )
    return Unit(rank, u["index"], u["name"], u["layer"], path, u["tensors"], views)


class _Views(Mapping):
    """A unit's tensors by name, in the manifest's order: each a view of the unit's
    buffer, made on its first use (a forward reads a few of a MoE unit's thousands)."""

    def __init__(self, base: torch.Tensor, infos: dict, names: list[str]):
        self._base, self._infos, self._names = base, infos, names
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        got = self._made.get(name)
        if got is None:
            if name not in self._infos or name.startswith(PAD_PREFIX):
                raise KeyError(name)
            t = self._infos[name]
            dtype = ST_DTYPES[t.st_dtype][0]
            if t.nbytes == 0:
                got = torch.empty(t.shape, dtype=dtype)
            else:
                flat = self._base[t.start : t.end]
                got = (flat if dtype == torch.uint8 else flat.view(dtype)).reshape(t.shape)
            self._made[name] = got
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
