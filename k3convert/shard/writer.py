"""``shard``: stream a checkpoint into a MUSA stream directory (spec: formats/).

Bounded memory: a unit is written tensor by tensor from zero-copy mmap slices of the
source, so a worker holds at most one tensor slice (plus padding) at a time.

Where the time goes, and how it is overlapped (the format requires every byte to be
read, hashed and made durable; sha256 is the bottleneck on CPU, the disk on I/O):

* source provenance hashes start first, on their own threads (one per file, up to
  ``workers``), while the plan is still being built: hashing one big file is serial
  and would otherwise become the tail;
* units are written in parallel (threads: hashing, zstd and file I/O release the GIL);
  each unit is hashed from the very buffers that are written, in cache-sized chunks, so
  nothing is read twice;
* each unit is handed to a background syncer as soon as it is renamed, so the disk
  writes it back while the CPUs work on later units and the final fsync pass before the
  commit finds almost nothing left to flush.

After each unit a journal entry (``.k3-journal/``) records its plan key and hash; a
rerun skips units whose key and on-disk hash still match, so an interrupted conversion
resumes. Journal entries are not fsynced: a lost entry only means a unit is rewritten,
and an entry that outlives its unit's bytes fails the hash check. Every unit (and every
carried file and rank directory) is fsynced before the manifest, which is written last,
atomically: it is the commit marker.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from tqdm import tqdm

from .. import __version__
from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import ConfigError, OutputError
from ..stream.format import (
    ALIGN,
    COMPRESSIONS,
    FORMAT,
    JOURNAL,
    MANIFEST,
    PAD_PREFIX,
    VERSION,
    dump_manifest,
)
from .layout import Layout
from .plan import Plan, TensorPlan, UnitPlan, build_plan

ZSTD_LEVEL = 3
# write / hash granularity: a chunk just copied into the page cache is still in the CPU
# cache when it is hashed (16 MiB chunks measured ~15% slower than 1 MiB here)
_CHUNK = 1 << 20
_GATHER = 64 << 10  # pieces smaller than this are gathered into one writev
_IOV_MAX = 512
_ZEROS = memoryview(bytes(ALIGN))  # padding never reaches ALIGN bytes


@dataclass(frozen=True)
class ShardResult:
    out: Path
    manifest: Path
    units_written: int
    units_skipped: int
    bytes_written: int
    seconds: float


class _HashingSink:
    """File-like: forwards writes, hashing and counting the bytes on the way."""

    def __init__(self, target):
        self.target, self.h, self.n = target, hashlib.sha256(), 0

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

    def __init__(self, fd: int, gather: bool = True):
        self.fd, self.h, self.n, self.gather = fd, hashlib.sha256(), 0, gather
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
    """sha256 of a file: large reads into one reused buffer, hashed in place."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(mv[:n])
            if on_bytes:
                on_bytes(n)
            if stop is not None and stop.is_set():
                raise _Cancelled
    return h.hexdigest()


class _Cancelled(Exception):
    pass


class _SourceHasher:
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


class _Syncer:
    """fsyncs finished units in the background, so writeback overlaps later units."""

    def __init__(self, threads: int = 2):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="k3sync")
        self.futs: dict[Path, Future] = {}

    def submit(self, path: Path) -> None:
        self.futs[path] = self.pool.submit(_fsync_path, path)

    def finish(self) -> set[Path]:
        """Wait for every fsync (re-raising the first failure); the paths synced."""
        self.pool.shutdown(wait=True)
        for f in self.futs.values():
            f.result()
        return set(self.futs)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _SourceMaps:
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
        if pm.raw is None:  # torch .bin source
            t = self.ck.get_parts(logical)[part].contiguous().reshape(-1)
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


def _tensor_bytes(src: _SourceMaps, tp: TensorPlan) -> memoryview:
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
    ck: Checkpoint, up: UnitPlan, out: Path, compression: str, on_bytes=None, fsync=True
) -> dict:
    """Write one unit (temp name, [fsync], rename); returns its manifest hash fields."""
    prefix, placed, total = up.header()
    if on_bytes:
        on_bytes(len(prefix))
    by_name = {t.entry["name"]: t for t in up.tensors}
    path = out / up.file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    src = _SourceMaps(ck)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            stored = _FdSink(fd, gather=compression == "none")  # zstd reuses its buffers
            cw = None
            if compression == "zstd":
                cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
                cw = cctx.stream_writer(stored, size=total, closefd=False)
                raw = _HashingSink(cw)
            else:
                raw = stored
            raw.write(prefix)
            for t in placed:
                if t.name.startswith(PAD_PREFIX):
                    raw.write(_ZEROS[: t.nbytes])
                else:
                    mv = _tensor_bytes(src, by_name[t.name])
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
                cw.flush(zstandard.FLUSH_FRAME)
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
        "sha256": stored.h.hexdigest(),
        "raw_bytes": raw.n,
        "raw_sha256": raw.h.hexdigest(),
    }


def _journal_path(out: Path, up: UnitPlan) -> Path:
    return out / JOURNAL / (up.file.replace("/", "__") + ".json")


def _plan_key(up: UnitPlan, compression: str, source_id: list) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "rank": up.rank,
        "unit": up.name,
        "file": up.file,
        "compression": compression,
        "tensors": [t.entry for t in up.tensors],
        "source": source_id,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _resumable(out: Path, up: UnitPlan, key: str) -> dict | None:
    """The journal's record of ``up`` when the unit on disk is still the one planned."""
    j = _journal_path(out, up)
    try:
        rec = json.loads(j.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    path = out / up.file
    if rec.get("key") != key or not path.is_file() or path.stat().st_size != rec.get("bytes"):
        return None
    if file_sha256(path) != rec.get("sha256"):
        return None
    return {k: rec[k] for k in ("bytes", "sha256", "raw_bytes", "raw_sha256")}


def _atomic_json(path: Path, doc: dict | str, fsync: bool = True) -> None:
    """Write ``doc`` (or its ready rendering) to a temporary name, [fsync], rename."""
    text = doc if isinstance(doc, str) else _render(doc)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)  # one write: json.dump would issue one per token
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def _render(doc: dict) -> str:
    return dump_manifest(doc)  # == json.dumps(doc, indent=1) + "\n", faster


def _fsync_path(path: Path) -> None:
    """fsync a file or directory (durability before the manifest commits)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; pass force=True to replace it.")
    if not out.exists():
        return
    complete = (out / MANIFEST).is_file()
    partial = (out / JOURNAL).is_dir()
    if force:
        shutil.rmtree(out)
        return
    if complete:
        raise OutputError(
            f"{out}: already holds a complete stream ({MANIFEST} present); pass force=True "
            f"(--force) to replace it, or choose another output directory."
        )
    if not partial and any(out.iterdir()):
        raise OutputError(
            f"{out}: exists, is not empty and is not an interrupted k3convert shard "
            f"(no {JOURNAL}/); choose an empty directory or pass force=True to replace it."
        )


def shard(
    *,
    src,
    out,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    compress: str = "none",
    workers: int | None = None,
    force: bool = False,
    pp_layers=None,
    expert_load=None,
    redundant_experts: int = 0,
    progress: bool = True,
    recipe: dict | None = None,
) -> ShardResult:
    """Reshard checkpoint ``src`` for ``tp`` x ``pp`` (experts over ``ep`` of the tp ranks)
    into the stream directory ``out``. See formats/musa-stream-v1.md.

    Resumable: rerunning after an interruption skips units already written intact.
    Refuses a complete ``out`` unless ``force``. ``pp_layers``: layer counts per stage;
    ``expert_load``: {layer: [tokens per expert]} or a JSON file of it (balances experts
    over EP ranks); ``redundant_experts``: extra replicas of the hottest experts per layer.
    ``workers``: units written in parallel (default: the number of CPUs); source files are
    hashed on up to as many threads besides, and finished units are fsynced in the
    background.
    """
    t0 = time.perf_counter()
    if compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {COMPRESSIONS}, got {compress!r}.")
    if workers is None:
        workers = os.cpu_count() or 2
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    out = Path(out)
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    ck = open_checkpoint(src)
    src_files = ck.files()
    lock = threading.Lock()
    bar = tqdm(
        total=sum(f.size for f in src_files),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"shard tp{tp} pp{pp} ep{ep}",
        disable=not progress,
        smoothing=0.1,
    )

    def tick(n: int) -> None:
        with lock:
            bar.update(n)

    # provenance hashes only read the source: start them now, they are the longest
    # serial jobs (one file each); cancelled if planning or writing fails
    hasher = _SourceHasher(ck.root, src_files, workers, tick)
    syncer: _Syncer | None = None
    try:
        plan = build_plan(
            ck,
            layout,
            compression=compress,
            pp_layers=pp_layers,
            expert_load=expert_load,
            redundant_experts=redundant_experts,
        )
        _prepare_out(out, force)
        total = sum(up.header()[2] for up in plan.units)
        parent = out if out.exists() else out.parent
        free = shutil.disk_usage(parent if parent.exists() else Path.cwd()).free
        if compress == "none" and free < total:
            raise OutputError(
                f"{out}: needs {total / 1e9:.2f} GB but {free / 1e9:.2f} GB are free; free "
                f"space or use compress='zstd'."
            )
        out.mkdir(parents=True, exist_ok=True)
        (out / JOURNAL).mkdir(exist_ok=True)
        with lock:
            bar.total += total
            bar.refresh()
        source_id = [
            [str(f.path.relative_to(ck.root)), f.size, f.path.stat().st_mtime_ns] for f in src_files
        ]
        results: dict[int, dict] = {}
        skipped = written = 0
        syncer = _Syncer()

        def do_unit(up: UnitPlan) -> None:
            nonlocal skipped, written
            key = _plan_key(up, compress, source_id)
            rec = _resumable(out, up, key)
            if rec is not None:
                tick(rec["raw_bytes"])
                with lock:
                    skipped += 1
            else:
                rec = write_unit(ck, up, out, compress, on_bytes=tick, fsync=False)
                syncer.submit(out / up.file)
                _atomic_json(_journal_path(out, up), {"key": key, **rec}, fsync=False)
                with lock:
                    written += 1
            results[id(up)] = rec

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3shard") as pool:
            futs = [pool.submit(do_unit, up) for up in plan.units]
            done, pending = wait(futs, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()
        sha = hasher.result()
        files = _carry_aux(ck, out)
        manifest = _render(_manifest(plan, ck, results, sha, files, compress, recipe))
        synced = syncer.finish()
    except BaseException:
        hasher.cancel()
        if syncer is not None:
            syncer.abort()
        raise
    finally:
        bar.close()
    to_sync = [out / up.file for up in plan.units if out / up.file not in synced]
    to_sync += [out / f["name"] for f in files]
    to_sync += sorted({(out / up.file).parent for up in plan.units})
    with ThreadPoolExecutor(max_workers=max(workers, 4)) as pool:
        list(pool.map(_fsync_path, to_sync))
    _atomic_json(out / MANIFEST, manifest)
    _fsync_dir(out)
    _cleanup(out, plan)
    return ShardResult(
        out,
        out / MANIFEST,
        written,
        skipped,
        sum(r["bytes"] for r in results.values()),
        time.perf_counter() - t0,
    )


def _carry_aux(ck: Checkpoint, out: Path) -> list[dict]:
    """Copy config.json, tokenizer, processor and other non-weight files; hash them."""
    srcs = [ck.root / "config.json", *ck.aux_files]
    files = []
    for p in srcs:
        if not p.is_file():
            continue
        dst = out / p.name
        tmp = dst.with_name(dst.name + f".tmp-{os.getpid()}")
        shutil.copyfile(p, tmp)
        os.replace(tmp, dst)
        files.append({"name": p.name, "bytes": dst.stat().st_size, "sha256": file_sha256(dst)})
    return files


def _manifest(plan: Plan, ck: Checkpoint, results, sha, files, compress, recipe) -> dict:
    lay = plan.layout
    ranks = []
    for r in range(lay.world):
        units = []
        for up in plan.rank_units(r):
            rec = results[id(up)]
            units.append(
                {
                    "index": up.index,
                    "name": up.name,
                    "layer": up.layer,
                    "file": up.file,
                    "compression": compress,
                    **rec,
                    "tensors": [t.entry for t in up.tensors],
                }
            )
        ranks.append({"rank": r, **lay.coords(r), "units": units})
    return {
        "format": FORMAT,
        "version": VERSION,
        "generator": f"k3convert {__version__}",
        "alignment": 4096,
        "model": plan.model,
        "layout": {
            **lay.to_json(),
            "world": lay.world,
            "stages": plan.stages,
            "experts": plan.experts,
        },
        "source": {
            "path": str(ck.root),
            "files": [
                {
                    "name": str(f.path.relative_to(ck.root)),
                    "bytes": f.size,
                    "sha256": sha[str(f.path.relative_to(ck.root))],
                }
                for f in ck.files()
            ],
            "recipe": recipe,
        },
        "files": files,
        "ranks": ranks,
    }


def _cleanup(out: Path, plan: Plan) -> None:
    """Drop the journal and any unit file the plan does not name (stale from a crash)."""
    shutil.rmtree(out / JOURNAL, ignore_errors=True)
    keep = {out / up.file for up in plan.units}
    dirs = {p.parent for p in keep}
    for d in out.glob("rank*"):
        if d.is_dir() and d not in dirs:
            shutil.rmtree(d)
        elif d.is_dir():
            for f in d.iterdir():
                if f not in keep:
                    f.unlink()
