"""``shard``: stream a checkpoint into a MUSA stream directory (spec: formats/).

Bounded memory: a unit is written tensor by tensor from zero-copy mmap slices of the
source, so a worker holds at most one tensor slice (plus padding) at a time. Units are
written in parallel (threads: slicing, hashing, zstd and file I/O all release the
GIL), each to a temporary name and renamed. After each unit a journal entry
(``.k3-journal/``) records its plan key and hash; a rerun skips units whose key and
on-disk hash still match, so an interrupted conversion resumes (a unit lost in a crash
fails that hash check and is rewritten, so units need not be fsynced one by one: all
are fsynced together, in parallel, before the commit). The manifest is written last,
atomically: it is the commit marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
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
    COMPRESSIONS,
    FORMAT,
    JOURNAL,
    MANIFEST,
    PAD_PREFIX,
    VERSION,
)
from .layout import Layout
from .plan import Plan, TensorPlan, UnitPlan, build_plan

ZSTD_LEVEL = 3
_CHUNK = 16 << 20


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


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


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
        item = torch.empty((), dtype=pm.dtype).element_size()
        shape = (*pm.shape[:-1], pm.shape[-1] * item) if pm.shape else (item,)
        if pm.raw is None:  # torch .bin source
            t = self.ck.get_parts(logical)[part].contiguous().reshape(-1)
            return t.view(torch.uint8).numpy().reshape(shape)
        if pm.file not in self.maps:
            self.maps[pm.file] = np.memmap(pm.file, dtype=np.uint8, mode="r")
        return self.maps[pm.file][pm.raw.start : pm.raw.end].reshape(shape)


def _tensor_bytes(src: _SourceMaps, tp: TensorPlan) -> memoryview:
    """The local tensor's bytes: a slice of the source part, zero-padded."""
    ps = tp.slice
    if ps.contents == "local_shape":
        t = torch.tensor(ps.value, dtype=ps.src.dtype)
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    u = src.part_bytes(tp.src_logical, ps.part)
    if ps.dim is not None:
        item = torch.empty((), dtype=ps.src.dtype).element_size()
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
    try:
        with open(tmp, "wb") as fh:
            stored = _HashingSink(fh)
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
                    raw.write(bytes(t.nbytes))
                else:
                    mv = _tensor_bytes(src, by_name[t.name])
                    if len(mv) != t.nbytes:
                        raise AssertionError(f"{up.file}: {t.name} size {len(mv)} != {t.nbytes}")
                    for i in range(0, len(mv), _CHUNK):
                        raw.write(mv[i : i + _CHUNK])
                if on_bytes:
                    on_bytes(t.nbytes)
            if cw is not None:
                cw.flush(zstandard.FLUSH_FRAME)
                cw.close()
            if raw.n != total:
                raise AssertionError(f"{up.file}: wrote {raw.n} bytes, planned {total}")
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
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


def _atomic_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
    workers: int = 1,
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
    """
    t0 = time.perf_counter()
    if compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {COMPRESSIONS}, got {compress!r}.")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    out = Path(out)
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    ck = open_checkpoint(src)
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
    src_files = ck.files()
    parent = out if out.exists() else out.parent
    free = shutil.disk_usage(parent if parent.exists() else Path.cwd()).free
    if compress == "none" and free < total:
        raise OutputError(
            f"{out}: needs {total / 1e9:.2f} GB but {free / 1e9:.2f} GB are free; free space "
            f"or use compress='zstd'."
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / JOURNAL).mkdir(exist_ok=True)
    source_id = [
        [str(f.path.relative_to(ck.root)), f.size, f.path.stat().st_mtime_ns] for f in src_files
    ]
    results: dict[int, dict] = {}
    skipped = written = 0
    lock = threading.Lock()
    bar = tqdm(
        total=total + sum(f.size for f in src_files),
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
            _atomic_json(_journal_path(out, up), {"key": key, **rec})
            with lock:
                written += 1
        results[id(up)] = rec

    sha: dict[str, str] = {}

    def do_hash(f) -> None:
        sha[str(f.path.relative_to(ck.root))] = file_sha256(f.path)
        tick(f.size)

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3shard") as pool:
            futs = [pool.submit(do_hash, f) for f in src_files]
            futs += [pool.submit(do_unit, up) for up in plan.units]
            done, pending = wait(futs, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()
    finally:
        bar.close()
    files = _carry_aux(ck, out)
    manifest = _manifest(plan, ck, results, sha, files, compress, recipe)
    to_sync = [out / up.file for up in plan.units] + [out / f["name"] for f in files]
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
