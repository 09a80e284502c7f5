"""Unit I/O for ``shard``: hashing sinks, source maps, the per-unit writer, durability.

Split from writer.py (which orchestrates): everything here works on one unit or one file
at a time. A unit is written tensor by tensor from zero-copy mmap slices of the source,
hashed from the very buffers that are written (nothing is read twice), optionally zstd
compressed, and renamed into place; fsyncs run on a background thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from ..checkpoint import Checkpoint
from ..stream import hashing as unit_hashing
from ..stream.format import ALIGN, FORMAT, JOURNAL, PAD_PREFIX, VERSION
from .plan import TensorPlan, UnitPlan

ZSTD_LEVEL = 3
# write / hash granularity: a chunk just copied into the page cache is still in the CPU
# cache when it is hashed (16 MiB chunks measured ~15% slower than 1 MiB here)
_CHUNK = 1 << 20
_GATHER = 64 << 10  # pieces smaller than this are gathered into one writev
_IOV_MAX = 512
_ZEROS = memoryview(bytes(ALIGN))  # padding never reaches ALIGN bytes


class _HashingSink:
    """File-like: forwards writes, hashing and counting the bytes on the way."""

    def __init__(self, target, algo: str):
        self.target, self.h, self.n = target, unit_hashing.new(algo), 0

    def write(self, b) -> int:
        self.target.write(b)
        self.h.update(b)
        self.n += len(b)
        return len(b)


class _FdSink:
    """Writes to a raw fd and hashes the very buffers it writes (no second read).

    Large buffers go out in :data:`_CHUNK` pieces, each hashed right after it was
    copied (still cache-hot); small ones (headers, padding, scales) are gathered and
    written with one ``os.writev``. Gathered buffers must stay unchanged until
    :meth:`flush`: callers pass immutable or freshly made buffers.
    """

    def __init__(self, fd: int, algo: str, gather: bool = True):
        self.fd, self.h, self.n, self.gather = fd, unit_hashing.new(algo), 0, gather
        self.pending: list = []
        self.pending_n = 0

    def write(self, b) -> int:
        mv = b if isinstance(b, memoryview) else memoryview(b)
        n = mv.nbytes
        if n < _GATHER and self.gather:
            self.h.update(mv)
            self.pending.append(mv)
            self.pending_n += n
            if self.pending_n >= _GATHER or len(self.pending) >= _IOV_MAX:
                self.flush()
        else:
            self.flush()
            for i in range(0, n, _CHUNK):
                c = mv[i : i + _CHUNK]
                self._write_all([c])
                self.h.update(c)
        self.n += n
        return n

    def flush(self) -> None:
        if self.pending:
            bufs, self.pending, self.pending_n = self.pending, [], 0
            self._write_all(bufs)

    def _write_all(self, bufs: list) -> None:
        while bufs:
            k = os.writev(self.fd, bufs) if len(bufs) > 1 else os.write(self.fd, bufs[0])
            while bufs and k >= bufs[0].nbytes:  # drop what went out (short writes)
                k -= bufs[0].nbytes
                bufs = bufs[1:]
            if k:
                bufs[0] = bufs[0][k:]


def file_sha256(path: Path, stop: threading.Event | None = None, on_bytes=None) -> str:
    """sha256 of a file (bare hex), :func:`unit_hashing.file_digest`'s loop; ``stop``
    cancels it between pieces, ``on_bytes(n)`` reports progress."""

    def each(n: int) -> None:
        if on_bytes:
            on_bytes(n)
        if stop is not None and stop.is_set():
            raise _Cancelled

    return unit_hashing.file_digest(path, "sha256", _CHUNK, each).split(":", 1)[1]


class _Cancelled(Exception):
    pass


class SourceHasher:
    """Hashes the source files (provenance) on background threads, largest first.

    Started before planning; :meth:`result` joins and returns ``{relative name: sha256}``
    (re-raising a read error), :meth:`cancel` stops early (a failed plan or write).
    """

    def __init__(self, root: Path, files: list, threads: int, on_bytes=None):
        self.root, self.on_bytes = root, on_bytes
        self.stop = threading.Event()
        self.sha: dict[str, str] = {}
        self.todo = sorted(files, key=lambda f: -f.size)
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._run, name=f"k3hash-{i}", daemon=True)
            for i in range(max(1, min(threads, len(files))))
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                if not self.todo:
                    return
                f = self.todo.pop(0)
            try:
                digest = file_sha256(f.path, self.stop, self.on_bytes)
            except _Cancelled:
                return
            except BaseException as e:  # re-raised by result()
                self.error = self.error or e
                self.stop.set()
                return
            self.sha[str(f.path.relative_to(self.root))] = digest

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def result(self) -> dict[str, str]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.sha

    def cancel(self) -> None:
        self.stop.set()
        self.join()


class Syncer:
    """fsyncs finished units in the background, so writeback overlaps later units."""

    def __init__(self, threads: int = 2):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="k3sync")
        self.futs: dict[Path, Future] = {}

    def submit(self, path: Path) -> None:
        self.futs[path] = self.pool.submit(fsync_path, path)

    def finish(self) -> set[Path]:
        """Wait for every fsync (re-raising the first failure); the paths synced."""
        self.pool.shutdown(wait=True)
        for f in self.futs.values():
            f.result()
        return set(self.futs)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class SourceMaps:
    """Whole-file read-only mappings of the source, for the duration of one unit.

    One mapping per source file instead of one per tensor part keeps the per-tensor cost
    low for many small tensors (experts); only the pages of the tensors being written are
    touched, and the mappings die with the unit, so memory stays bounded. Bytes are
    sliced with numpy: torch's multi-threaded strided copy is far slower for this.
    """

    def __init__(self, ck: Checkpoint):
        self.ck, self.maps = ck, {}

    def part_bytes(self, logical: str, part: str) -> np.ndarray:
        """uint8 array of the part, shaped ``shape[:-1] + (shape[-1] * itemsize,)``."""
        pm = self.ck.meta(logical).parts[part]
        item = _itemsize(pm.dtype)
        shape = (*pm.shape[:-1], pm.shape[-1] * item) if pm.shape else (item,)
        if pm.raw is None:  # convert's planned tensors: a source part, as stored?
            same = getattr(self.ck, "source_part", None)
            pm = (same(logical, part) if same is not None else None) or pm
        if pm.raw is None:  # a torch .bin source, or a tensor produced on demand (convert)
            one = getattr(self.ck, "part_tensor", None)
            t = one(logical, part) if one is not None else self.ck.get_parts(logical)[part]
            t = t.contiguous().reshape(-1)
            return t.view(torch.uint8).numpy().reshape(shape)
        m = self.maps.get(pm.file)
        if m is None:  # a plain ndarray over an mmap: np.memmap's slicing costs more
            with open(pm.file, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            m = self.maps[pm.file] = np.frombuffer(mm, dtype=np.uint8)
        return m[pm.raw.start : pm.raw.end].reshape(shape)


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(src: SourceMaps, tp: TensorPlan) -> memoryview:
    """The local tensor's bytes: a slice of the source part, zero-padded."""
    ps = tp.slice
    if ps.contents == "local_shape":
        t = torch.tensor(ps.value, dtype=ps.src.dtype)
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    u = src.part_bytes(tp.src_logical, ps.part)
    if ps.dim is not None:
        item = _itemsize(ps.src.dtype)
        scale = item if ps.dim == len(ps.src.shape) - 1 else 1
        idx = [slice(None)] * u.ndim
        idx[ps.dim] = slice(ps.start * scale, (ps.start + ps.length) * scale)
        u = u[tuple(idx)]
        if ps.pad:
            shape = list(u.shape)
            shape[ps.dim] = ps.pad * scale
            u = np.concatenate([u, np.zeros(shape, dtype=np.uint8)], axis=ps.dim)
    return memoryview(np.ascontiguousarray(u)).cast("B")


def write_unit(
    ck: Checkpoint,
    up: UnitPlan,
    out: Path,
    compression: str,
    on_bytes=None,
    fsync=True,
    unit_hash: str = unit_hashing.DEFAULT,
) -> dict:
    """Write one unit (temp name, [fsync], rename); returns its manifest size and hash
    fields (``hash`` / ``raw_hash`` as ``ALGO:HEX``)."""
    prefix, placed, total = up.header()
    if up.nbytes and total != up.nbytes:  # the tensors changed since the plan was made
        raise AssertionError(f"{up.file}: header gives {total} bytes, planned {up.nbytes}")
    if on_bytes:
        on_bytes(len(prefix))
    by_name = {t.entry["name"]: t for t in up.tensors}
    path = out / up.file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    src = SourceMaps(ck)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            stored = _FdSink(fd, unit_hash, gather=compression == "none")  # zstd reuses its buffers
            cw = None
            if compression == "zstd":
                cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
                cw = cctx.stream_writer(stored, size=total, closefd=False)
                raw = _HashingSink(cw, unit_hash)
            else:
                raw = stored
            raw.write(prefix)
            for t in placed:
                if t.name.startswith(PAD_PREFIX):
                    raw.write(_ZEROS[: t.nbytes])
                else:
                    mv = tensor_bytes(src, by_name[t.name])
                    if len(mv) != t.nbytes:
                        raise AssertionError(f"{up.file}: {t.name} size {len(mv)} != {t.nbytes}")
                    if cw is None:
                        raw.write(mv)
                    else:
                        for i in range(0, len(mv), _CHUNK):
                            raw.write(mv[i : i + _CHUNK])
                if on_bytes:
                    on_bytes(t.nbytes)
            if cw is not None:
                # close() ends the frame: exactly one frame per unit (spec 3.2); a
                # flush(FLUSH_FRAME) first would make close() append a second, empty one
                cw.close()
            stored.flush()
            if raw.n != total:
                raise AssertionError(f"{up.file}: wrote {raw.n} bytes, planned {total}")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {
        "bytes": stored.n,
        "hash": unit_hashing.tag(unit_hash, stored.h.hexdigest()),
        "raw_bytes": raw.n,
        "raw_hash": unit_hashing.tag(unit_hash, raw.h.hexdigest()),
    }


def journal_path(out: Path, up: UnitPlan) -> Path:
    return out / JOURNAL / (up.file.replace("/", "__") + ".json")


def plan_key(up: UnitPlan, compression: str, source_id: list, unit_hash: str) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "unit_hash": unit_hash,
        "rank": up.rank,
        "unit": up.name,
        "file": up.file,
        "compression": compression,
        "zstd_frames": 1,  # units of older writers held two frames: rewrite them
        "tensors": [t.entry for t in up.tensors],
        "source": source_id,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def resumable(out: Path, up: UnitPlan, key: str) -> dict | None:
    """The journal's record of ``up`` when the unit on disk is still the one planned."""
    j = journal_path(out, up)
    try:
        rec = json.loads(j.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    path = out / up.file
    if rec.get("key") != key or not path.is_file() or path.stat().st_size != rec.get("bytes"):
        return None
    try:
        algo, _ = unit_hashing.split(rec.get("hash"))
    except ValueError:  # a damaged journal entry: the unit is rewritten
        return None
    if unit_hashing.file_digest(path, algo) != rec["hash"]:
        return None
    return {k: rec[k] for k in ("bytes", "hash", "raw_bytes", "raw_hash")}


def fsync_path(path: Path) -> None:
    """fsync a file or directory (durability before the manifest commits)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
