"""``shard``: stream a checkpoint into a MUSA stream directory (spec: formats/).

Bounded memory: a unit is written tensor by tensor from zero-copy mmap slices of the
source, so a worker holds at most one tensor slice (plus padding) at a time.

Where the time goes, and how it is overlapped (the format requires every byte to be
read, hashed and made durable; sha256 is the bottleneck on CPU, the disk on I/O):

* source provenance hashes start first, on their own threads (one per file, up to
  ``workers``), as soon as OUT is prepared and alongside the units: hashing one big file
  is serial and would otherwise become the tail (under torchrun each process hashes its
  share of the files, balanced by bytes);
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
carried file and rank directory) is fsynced before the rank files (each rank's unit
entries, ``rankNNNNN/units.json``, written atomically and fsynced), and those before
the manifest, which is written last, atomically: it is the commit marker.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from ..checkpoint.bounded import read_json
from ..checkpoint.output import (
    check_replaceable,
    free_bytes,
    guard_out,
    probe_writable,
    reports_write_errors,
)
from ..checkpoint.tokenizer_files import check_engine_json
from ..errors import ConfigError, OutputError
from ..layout import Layout
from ..parallel import procs
from ..parallel.procs import ProcessGroup
from ..stream import hashing as unit_hashing
from ..stream.format import (
    COMPRESSIONS,
    FORMAT,
    JOURNAL,
    MANIFEST,
    VERSION,
    rank_units_file,
)
from ..stream.manifest_doc import atomic_json, units_algo, write_manifest_ranks
from ..units import byte_bar
from .plan import ROUTING_COUNTS, Plan, UnitPlan, build_plan
from .unit_io import (
    SourceHasher,
    Syncer,
    file_sha256,
    fsync_path,
    journal_path,
    plan_key,
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
    #: bytes written more than once (the same slice on several ranks: Plan.replicated_bytes)
    replicated_bytes: int = 0
    #: the source's weight bytes
    source_bytes: int = 0


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
            f"{out}: already holds a complete stream ({MANIFEST} present), and shard does "
            f"not rewrite a finished output: `k3convert shard --check {out}` checks it, "
            f"--force replaces it, or choose another output directory."
        )
    if not partial and any(out.iterdir()):
        raise OutputError(
            f"{out}: exists, is not empty and is not an interrupted k3convert shard "
            f"(no {JOURNAL}/); choose an empty directory or pass --force to replace it."
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
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    ck = open_checkpoint(src)
    out = Path(out)
    guard_out(out, [ck.root])
    picked = None
    if expert_load is None and redundant_experts:
        cand = Path(ck.root) / ROUTING_COUNTS
        if cand.is_file():
            expert_load = picked = cand
    plan = build_plan(
        ck,
        layout,
        compression=compress,
        pp_layers=pp_layers,
        expert_load=expert_load,
        redundant_experts=redundant_experts,
    )
    res = write_stream(
        data=ck, plan=plan, out=out, source=ck, carry=carried_files(ck), compress=compress,
        workers=workers, force=force, progress=progress, recipe=recipe, unit_hash=unit_hash,
        desc=f"shard tp{tp} pp{pp} ep{ep}",
    )  # fmt: skip
    return dataclasses.replace(res, seconds=time.perf_counter() - t0, expert_load_from=picked)


def check_write_options(compress: str, unit_hash: str, workers) -> int:
    """The writer's options checked; returns the number of workers."""
    if compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {COMPRESSIONS}, got {compress!r}.")
    if unit_hash not in unit_hashing.ALGORITHMS:
        raise ConfigError(
            f"unit hash must be one of {', '.join(unit_hashing.ALGORITHMS)}, got {unit_hash!r}."
        )
    if workers is None:
        workers = max(2, procs.cores_per_process())  # I/O and hashing overlap: at least 2
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}.")
    return workers


def write_stream(
    *,
    data,
    plan: Plan,
    out: Path,
    source: Checkpoint,
    carry: list[tuple[str, Path | bytes]],
    compress: str = "none",
    workers: int | None = None,
    force: bool = False,
    progress: bool = True,
    recipe: dict | None = None,
    unit_hash: str = unit_hashing.DEFAULT,
    identity: object = None,
    desc: str = "shard",
    bar: tqdm | None = None,
    group: ProcessGroup | None = None,
    share_by_layer: bool = False,
    on_unit=None,
) -> ShardResult:
    """Write ``plan``'s units into the stream directory ``out`` and commit the manifest.

    data: where the units' tensor bytes come from (a Checkpoint, or convert's planned
    checkpoint producing quantized tensors on demand); source: the checkpoint recorded in
    the manifest (its files hashed); carry: (name, file or bytes) copied next to the
    manifest (config.json first); identity: extra JSON-able data that must match for a
    unit of an earlier run to be reused (convert: the quantization's fingerprint); bar: a
    progress bar to advance instead of a new one. group: the torchrun job (default: the
    current one); each process writes its share of the units (balanced by bytes: single
    units, or whole layers with ``share_by_layer``), process 0 prepares OUT before and
    writes the manifest after the others have reported. on_unit(unit): called as each
    unit starts (progress displays). ``data.expect(units)``, when ``data`` has it, is told
    which units this process writes before the first one, ``data.skip(unit)`` of each
    one a rerun finds intact.
    """
    t0 = time.perf_counter()
    workers = check_write_options(compress, unit_hash, workers)
    group = group if group is not None else procs.current()
    src_files = source.files()
    lock = threading.Lock()
    own_bar = bar is None
    if own_bar:
        bar = byte_bar(total=0, desc=desc, disable=not progress or not group.leader,
                       smoothing=0.1)  # fmt: skip

    def tick(n: int) -> None:
        with lock:
            bar.update(n)

    mine = _my_units(plan, group, share_by_layer)
    my_files = procs.balance(src_files, lambda f: f.size, group.world)[group.rank]
    # provenance hashes only read the source: start them now, they are the longest
    # serial jobs (one file each); cancelled if writing fails
    hasher = None
    syncer: Syncer | None = None
    try:
        total = sum(up.nbytes for up in plan.units)
        err = _prepare_stream_dir(out, force, total) if group.leader else None
        group.agree(err, f"preparing {out}")
        # (not *.json: the journal's unit entries are; a rerun told apart by those)
        fp_file = out / JOURNAL / f"source-{group.rank}-of-{group.world}.fingerprint"
        # a rerun (process 0 decides for all: the others may see this run's entries)
        resuming = group.share(_has_unit_entries(out) if group.leader else None)
        earlier = _read_fingerprint(fp_file) if resuming else None
        if resuming:  # recorded again only once the stale units are dropped
            fp_file.unlink(missing_ok=True)
        hasher = SourceHasher(source.root, my_files, workers, tick)
        recorder = None
        if not resuming:  # nothing stale to drop: recorded as soon as hashed
            recorder = threading.Thread(
                target=_record_fingerprint, args=(hasher, fp_file, len(my_files)),
                name="k3hash-record", daemon=True,
            )  # fmt: skip
            recorder.start()
        with lock:
            bar.total = (bar.total or 0) + sum(f.size for f in my_files)
            bar.total += sum(up.nbytes for up in mine)
            bar.refresh()
        source_id = [
            [str(f.path.relative_to(source.root)), f.size, f.path.stat().st_mtime_ns]
            for f in src_files
        ]
        if identity is not None:
            source_id.append({"identity": identity})
        syncer = Syncer()
        expect = getattr(data, "expect", None)
        if expect is not None:
            expect(mine)
        units = _UnitWriter(data, out, compress, unit_hash, source_id, tick, lock, syncer,
                            on_unit)  # fmt: skip
        try:
            if resuming:
                _forget_if_source_changed(out, mine, group, earlier, hasher, fp_file)
            units.write(mine, workers)
            sha = hasher.result()
            if recorder is not None:
                recorder.join()  # (its file is in the journal, which the commit removes)
            synced = syncer.finish()
            to_sync = [out / up.file for up in mine if out / up.file not in synced]
            to_sync += sorted({(out / up.file).parent for up in mine})
            with ThreadPoolExecutor(max_workers=max(workers, 4)) as pool:
                list(pool.map(fsync_path, to_sync))
        except BaseException as e:
            if not isinstance(e, Exception) or group.world == 1:
                raise
            err, sha = e, {}
        group.agree(err, f"writing its units of {out}")
        shares = group.gather((units.results, sha, units.written, units.skipped))
    except BaseException:
        if hasher is not None:
            hasher.cancel()
        if syncer is not None:
            syncer.abort()
        raise
    finally:
        if own_bar:
            bar.close()
    return _commit_shares(out, plan, source, shares, carry, compress, recipe, workers, group, t0)


def _commit_shares(out: Path, plan: Plan, source, shares: list, carry, compress: str, recipe,
                   workers: int, group: ProcessGroup, t0: float) -> ShardResult:  # fmt: skip
    """Every process's share of the units (``shares``: results, source hashes, written,
    skipped) merged; process 0 commits, every process agrees on its error; the result
    (``t0``: when writing started)."""
    all_results: dict[int, dict] = {}
    all_sha: dict[str, str] = {}
    for r, h, _, _ in shares:
        all_results.update(r)
        all_sha.update(h)
    err = None
    if group.leader:
        try:
            _commit(out, plan, source, all_results, all_sha, carry, compress, recipe, workers)
        except BaseException as e:
            if not isinstance(e, Exception) or group.world == 1:
                raise
            err = e
    group.agree(err, f"committing {out}")
    return ShardResult(
        out,
        out / MANIFEST,
        sum(s[2] for s in shares),
        sum(s[3] for s in shares),
        sum(r["bytes"] for r in all_results.values()),
        time.perf_counter() - t0,
        None,
        plan.replicated_bytes(),
        sum(f.size for f in source.files()),
    )


def _has_unit_entries(out: Path) -> bool:
    """Whether an earlier run left unit entries (True when it cannot tell: the content
    check that follows then decides)."""
    j = out / JOURNAL
    try:
        return j.is_dir() and any(p.suffix == ".json" for p in j.iterdir())
    except OSError:
        return True


def _read_fingerprint(path: Path) -> dict | None:
    try:
        doc = read_json(path, "report", OutputError)
    except OutputError:
        return None
    return doc


def _record_fingerprint(hasher: SourceHasher, path: Path, n_files: int) -> None:
    """This process's share of the source by content, in the journal as soon as it is
    hashed (all of it: a cancelled hash records nothing): what a rerun compares before
    it keeps a unit of this run."""
    try:
        sha = hasher.result()
    except BaseException:  # (re-raised where the writer calls result())
        return
    if hasher.stop.is_set() or len(sha) != n_files:
        return
    with contextlib.suppress(OSError):  # (then a rerun rewrites every unit: never wrong)
        atomic_json(path, dict(sorted(sha.items())), fsync=False)


def _forget_if_source_changed(out: Path, mine, group: ProcessGroup, earlier, hasher,
                              fp_file: Path) -> None:  # fmt: skip
    """Keep an interrupted run's units only if the source is the same by content (the
    sha256 of every file, not size and mtime): a file swapped for another of the same
    size with its mtime restored would otherwise mix two checkpoints in one stream.
    Every process hashes and compares its share (every process reaches each collective,
    a failed hash included); if any differs (or was never recorded), every process drops
    its units' journal entries. Only then, after a barrier, is the new fingerprint
    recorded: an interruption before that leaves none, and the next run rewrites all."""
    err, now = None, None
    try:
        now = dict(sorted(hasher.result().items()))
    except Exception as e:
        err = e
    group.agree(err, "hashing the source")
    same = all(group.gather(earlier is not None and earlier == now))
    if not same:
        for up in mine:
            journal_path(out, up).unlink(missing_ok=True)
    group.barrier()
    if not hasher.stop.is_set():
        with contextlib.suppress(OSError):
            atomic_json(fp_file, now, fsync=False)


def _prepare_stream_dir(out: Path, force: bool, total: int) -> BaseException | None:
    """Process 0's preparation of OUT (replaced with ``force``, writable, room for
    ``total`` bytes, the journal directory): the error, for every process to agree on."""
    try:
        _prepare_out(out, force)
        probe_writable(out, inside=True)
        held = sum(f.stat().st_size for f in out.glob("rank*/*") if f.is_file())
        free = free_bytes(out) + held
        if free < total:  # zstd rarely saves more than a few percent on weights
            raise OutputError(
                f"{out}: needs about {total / 1e9:.2f} GB (uncompressed size; zstd "
                f"saves little on weights) but {free / 1e9:.2f} GB are free; free "
                f"space or choose another OUT."
            )
        out.mkdir(parents=True, exist_ok=True)
        (out / JOURNAL).mkdir(exist_ok=True)
    except BaseException as e:
        return e
    return None


class _UnitWriter:
    """Writes this process's units (``workers`` at a time), or takes a unit a rerun
    finds intact (its journal entry matches the unit's key): ``results`` by unit,
    ``written`` / ``skipped`` counts. ``data.skip(unit)``, when ``data`` has it, is told
    of each unit taken as it is."""

    def __init__(self, data, out: Path, compress: str, unit_hash: str, source_id, tick, lock,
                 syncer: Syncer, on_unit):  # fmt: skip
        self.data, self.out, self.compress, self.unit_hash = data, out, compress, unit_hash
        self.source_id, self.tick, self.lock, self.syncer = source_id, tick, lock, syncer
        self.on_unit = on_unit
        self.skip = getattr(data, "skip", None)
        self.results: dict[tuple[int, int], dict] = {}
        self.written = self.skipped = 0

    def unit(self, up: UnitPlan) -> None:
        if self.on_unit is not None:
            self.on_unit(up)
        out = self.out
        key = plan_key(up, self.compress, self.source_id, self.unit_hash)
        rec = resumable(out, up, key)
        if rec is not None:
            if self.skip is not None:
                self.skip(up)
            self.tick(rec["raw_bytes"])
            with self.lock:
                self.skipped += 1
        else:
            rec = write_unit(self.data, up, out, self.compress, on_bytes=self.tick, fsync=False,
                             unit_hash=self.unit_hash)  # fmt: skip
            self.syncer.submit(out / up.file)
            atomic_json(journal_path(out, up), {"key": key, **rec}, fsync=False)
            with self.lock:
                self.written += 1
        self.results[up_id(up)] = rec

    def write(self, units: list[UnitPlan], workers: int) -> None:
        """Every unit of ``units``; the first failure cancels the ones not started."""
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3shard") as pool:
            futs = [pool.submit(self.unit, up) for up in units]
            done, pending = wait(futs, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()


def _commit(out: Path, plan: Plan, source, results: dict, sha: dict, carry, compress: str,
            recipe, workers: int) -> None:  # fmt: skip
    """Process 0's commit: the carried files, fsynced; the rank files, then manifest.json
    (the commit); the journal removed."""
    files = _carry(carry, out)
    doc = _manifest(plan, source, sha, files, recipe)
    with ThreadPoolExecutor(max_workers=max(workers, 4)) as pool:
        list(pool.map(fsync_path, [out / f["name"] for f in files]))
    # the rank files (each rank's units, built as its file is written), fsynced, then
    # manifest.json: the commit
    algo = units_algo(results.values())  # (every unit of a stream uses the one algorithm)
    write_manifest_ranks(out, doc, lambda r: _rank_units(plan, r, results, compress), algo)
    _cleanup(out, plan)


def up_id(up: UnitPlan) -> tuple[int, int]:
    """A unit's key that survives pickling between processes: (rank, index)."""
    return up.rank, up.index


def _my_units(plan: Plan, group: ProcessGroup, by_layer: bool) -> list[UnitPlan]:
    if group.world == 1:
        return list(plan.units)
    if not by_layer:
        items = [[up] for up in plan.units]
    else:
        grouped: dict[str, list[UnitPlan]] = {}
        for up in plan.units:
            grouped.setdefault(up.name, []).append(up)
        items = list(grouped.values())
    share = procs.balance(items, lambda ups: sum(u.nbytes for u in ups), group.world)
    return [up for ups in share[group.rank] for up in ups]


def carried_files(ck: Checkpoint) -> list[tuple[str, Path | bytes]]:
    """config.json, tokenizer, processor and other non-weight files of a checkpoint
    (the JSON files an engine parses checked first: :func:`check_engine_json`)."""
    files = [p for p in [ck.root / "config.json", *ck.aux_files] if p.is_file()]
    check_engine_json(files)
    return [(p.name, p) for p in files]


def _carry(carry: list[tuple[str, Path | bytes]], out: Path) -> list[dict]:
    """Copy (or write) the carried non-weight files next to the manifest; hash them."""
    names = [n for n, _ in carry]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # the manifest would list one name twice with two hashes
        raise AssertionError(f"carried files named twice: {dup}")
    files = []
    for name, what in carry:
        dst = out / name
        tmp = dst.with_name(dst.name + f".tmp-{os.getpid()}")
        if isinstance(what, bytes):
            tmp.write_bytes(what)
        else:
            shutil.copyfile(what, tmp)
        os.replace(tmp, dst)
        files.append({"name": name, "bytes": dst.stat().st_size, "sha256": file_sha256(dst)})
    return files


def _rank_units(plan: Plan, r: int, results: dict, compress: str) -> list[dict]:
    """Rank ``r``'s unit entries for its rank file (each unit's tensors built now)."""
    return [
        {
            "index": up.index,
            "name": up.name,
            "layer": up.layer,
            "file": up.file,
            "compression": compress,
            **results[up_id(up)],
            "tensors": [t.entry for t in up.tensors],
        }
        for up in plan.rank_units(r)
    ]


def _manifest(plan: Plan, ck: Checkpoint, sha, files, recipe) -> dict:
    """The manifest document, each rank's ``units`` a placeholder that
    :func:`_rank_units` fills as the rank's file is written."""
    lay = plan.layout
    ranks = [{"rank": r, **lay.coords(r), "units": None} for r in range(lay.world)]
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
    """Drop the journal and any file in a rank directory that is neither a unit the plan
    names nor the rank's units file (stale from a crash: old units, temporary names)."""
    shutil.rmtree(out / JOURNAL, ignore_errors=True)
    keep = {out / up.file for up in plan.units}
    keep |= {out / rank_units_file(r) for r in range(plan.layout.world)}
    dirs = {p.parent for p in keep}
    for d in out.glob("rank*"):
        if d.is_dir() and d not in dirs:
            shutil.rmtree(d)
        elif d.is_dir():
            for f in d.iterdir():
                if f not in keep:
                    f.unlink()
