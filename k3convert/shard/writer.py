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

import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .. import __version__
from ..checkpoint import Checkpoint, open_checkpoint
from ..checkpoint.output import (
    check_replaceable,
    free_bytes,
    guard_out,
    probe_writable,
    reports_write_errors,
)
from ..errors import ConfigError, OutputError
from ..stream import hashing as unit_hashing
from ..stream.format import (
    COMPRESSIONS,
    FORMAT,
    JOURNAL,
    MANIFEST,
    VERSION,
)
from .layout import Layout
from .plan import ROUTING_COUNTS, Plan, UnitPlan, build_plan
from .unit_io import (
    SourceHasher,
    Syncer,
    atomic_json,
    file_sha256,
    fsync_dir,
    fsync_path,
    journal_path,
    plan_key,
    render,
    resumable,
    write_unit,
)


@dataclass(frozen=True)
class ShardResult:
    out: Path
    manifest: Path
    units_written: int
    units_skipped: int
    bytes_written: int
    seconds: float
    #: the routing counts file picked up from SRC (``routing_counts.json``), if one was
    expert_load_from: Path | None = None


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; remove it or choose another OUT.")
    if not out.exists():
        return
    complete = (out / MANIFEST).is_file()
    partial = (out / JOURNAL).is_dir()
    if force:
        check_replaceable(out, complete or partial, "stream (no manifest.json / .k3-journal)")
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


@reports_write_errors
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
    unit_hash: str = unit_hashing.DEFAULT,
) -> ShardResult:
    """Reshard checkpoint ``src`` for ``tp`` x ``pp`` (experts over ``ep`` of the tp ranks)
    into the stream directory ``out``. See formats/musa-stream.md.

    Resumable: rerunning after an interruption skips units already written intact.
    Refuses a complete ``out`` unless ``force``. ``pp_layers``: layer counts per stage;
    ``expert_load``: {layer: [tokens per expert]} or a JSON file of it (balances experts
    over EP ranks); ``redundant_experts``: extra replicas of the hottest experts per layer.
    With ``redundant_experts`` and no ``expert_load``, ``SRC/routing_counts.json`` (written
    by a calibrated ``quantize``) is used when present (``ShardResult.expert_load_from``).
    ``workers``: units written in parallel (default: the number of CPUs); source files are
    hashed on up to as many threads besides, and finished units are fsynced in the
    background. ``unit_hash``: ``xxh3-128`` (default) or ``sha256`` for the units'
    integrity hashes (source files are always recorded with sha256).
    """
    t0 = time.perf_counter()
    if compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {COMPRESSIONS}, got {compress!r}.")
    if unit_hash not in unit_hashing.ALGORITHMS:
        raise ConfigError(
            f"unit hash must be one of {', '.join(unit_hashing.ALGORITHMS)}, got {unit_hash!r}."
        )
    if workers is None:
        workers = os.cpu_count() or 2
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    out = Path(out)
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    ck = open_checkpoint(src)
    guard_out(out, [ck.root])
    picked = None
    if expert_load is None and redundant_experts:
        cand = Path(ck.root) / ROUTING_COUNTS
        if cand.is_file():
            expert_load = picked = cand
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
    hasher = SourceHasher(ck.root, src_files, workers, tick)
    syncer: Syncer | None = None
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
        probe_writable(out, inside=True)
        free = free_bytes(out) + sum(f.stat().st_size for f in out.glob("rank*/*") if f.is_file())
        if free < total:  # zstd rarely saves more than a few percent on weights
            raise OutputError(
                f"{out}: needs about {total / 1e9:.2f} GB (uncompressed size; zstd saves "
                f"little on weights) but {free / 1e9:.2f} GB are free; free space or choose "
                f"another OUT."
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
        syncer = Syncer()

        def do_unit(up: UnitPlan) -> None:
            nonlocal skipped, written
            key = plan_key(up, compress, source_id, unit_hash)
            rec = resumable(out, up, key)
            if rec is not None:
                tick(rec["raw_bytes"])
                with lock:
                    skipped += 1
            else:
                rec = write_unit(
                    ck, up, out, compress, on_bytes=tick, fsync=False, unit_hash=unit_hash
                )
                syncer.submit(out / up.file)
                atomic_json(journal_path(out, up), {"key": key, **rec}, fsync=False)
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
        manifest = render(_manifest(plan, ck, results, sha, files, compress, recipe))
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
        list(pool.map(fsync_path, to_sync))
    atomic_json(out / MANIFEST, manifest)
    fsync_dir(out)
    _cleanup(out, plan)
    return ShardResult(
        out,
        out / MANIFEST,
        written,
        skipped,
        sum(r["bytes"] for r in results.values()),
        time.perf_counter() - t0,
        picked,
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
            "path": str(Path(ck.root).resolve()),
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
